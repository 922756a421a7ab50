import pytest
import torch

from tandem.devices import DeviceError, DeviceInfo, dtype_for, resolve_device, resolve_dtype


@pytest.mark.parametrize(
    "kind,arch,dtype",
    [
        ("rocm", "gfx1100", torch.float16),
        ("rocm", "gfx942", torch.bfloat16),
        ("cuda", "sm90", torch.bfloat16),
        ("cuda", "sm80", torch.bfloat16),
        ("cuda", "sm75", torch.float16),
        ("mps", "apple", torch.float16),
        ("cpu", "avx512_bf16", torch.bfloat16),
        ("cpu", "generic", torch.float32),
    ],
)
def test_auto_dtype_table_picks_the_native_16_bit_format_per_device(kind, arch, dtype):
    assert dtype_for(DeviceInfo(kind, arch)) == dtype


def test_explicit_dtype_and_unavailable_device_are_checked():
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(DeviceError):
        resolve_dtype("int8", torch.device("cpu"))
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError):
            resolve_device("cuda")
