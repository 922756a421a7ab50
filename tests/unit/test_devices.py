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


def test_host_has_accelerator_reads_device_nodes_without_torch(monkeypatch, tmp_path):
    import tandem.devices as devices

    assert isinstance(devices.host_has_accelerator(), bool)
    if not devices.host_has_accelerator():  # no device node: "auto" is the CPU
        assert resolve_device("auto").type == "cpu"
    monkeypatch.setattr(devices.sys, "platform", "linux")
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(devices, "Path", lambda p: tmp_path / "absent")
    assert devices.host_has_accelerator() is False
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert devices.host_has_accelerator() is True
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(devices, "Path", lambda p: tmp_path)  # /dev/kfd: ROCm
    assert devices.host_has_accelerator() is True
    monkeypatch.setattr(devices.sys, "platform", "darwin")
    monkeypatch.setattr(devices.platform, "machine", lambda: "arm64")
    assert devices.host_has_accelerator() is True
    monkeypatch.setattr(devices.platform, "machine", lambda: "x86_64")
    assert devices.host_has_accelerator() is False


def test_dtype_names_are_the_compute_dtypes():
    from tandem.devices import COMPUTE_DTYPES, DTYPE_NAMES, compute_dtype

    assert tuple(DTYPE_NAMES) == COMPUTE_DTYPES
    assert compute_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(DeviceError):
        compute_dtype("int8")
