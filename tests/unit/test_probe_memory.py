"""The GEMV probe's weight goes back to the OS when the probe ends (`device_probe.probe_operands`):
every group formed again probes anew, on the re-form's thread, so a weight left in an allocator's
heap would step the head's RSS up at a re-form. Checked the hard way: glibc's mmap threshold is
raised first (a 24 MiB block handed back, as an earlier probe's weight would have been), so a
16 MiB weight from the heap would stay mapped after it is dropped; the probe's own mapping must be
gone from /proc/self/maps."""

import gc
import sys
from pathlib import Path

import pytest
import torch

from tandem.engine import device_probe as dp


def _mapped(addr: int) -> bool:
    """Whether `addr` lies in any mapping of this process."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, _, end = line.split()[0].partition("-")
        if int(start, 16) <= addr < int(end, 16):
            return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps, glibc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_weight_is_unmapped_when_the_probe_ends(dtype) -> None:
    big = torch.ones(24 << 20, dtype=torch.uint8)  # mmapped, then freed: the threshold rises
    del big
    w, x = dp.probe_operands(torch.device("cpu"), dtype)
    assert w.numel() * w.element_size() == dp.PROBE_BYTES and w.is_contiguous()
    assert torch.isfinite(w).all() and 0.9 < float(w.float().std()) < 1.1  # N(0, 1) draws
    addr = w.data_ptr() + w.numel() * w.element_size() // 2  # a page inside it
    assert _mapped(addr)
    del w, x
    gc.collect()
    assert not _mapped(addr), "the probe's weight stayed mapped after the probe"
