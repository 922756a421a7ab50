"""Host staging: the one road from any device to the wire and back.

Every backend that moves bytes (reference, ring, star, the pipeline stage transport) stages through
`stage_to_host`, so no device type can lack an arm (the paper's Bug 2): `Tensor.to("cpu")` is the
single crossing, whatever the source device is (cuda, rocm-as-cuda, mps, xpu, cpu).

Floats travel in the negotiated wire dtype (float32 by default, a lossless superset of float16 and
bfloat16) and are reduced in float32; integers travel as themselves. Bytes are never reinterpreted
as another dtype: a payload is decoded by the dtype code its frame names (the paper's dtype hazard).
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.comm.base import CommError
from tandem.wire import dtypes as wd


class WireDtypeError(CommError, TypeError):
    """A payload dtype that cannot be staged as asked (e.g. an integer tensor on a float wire)."""


_NP = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
}
_TORCH_TO_WIRE = {
    torch.float32: wd.FLOAT32,
    torch.float16: wd.FLOAT16,
    torch.bfloat16: wd.BFLOAT16,
    torch.int64: wd.INT64,
    torch.int32: wd.INT32,
    torch.uint8: wd.UINT8,
}
_WIRE_TO_TORCH = {v.code: k for k, v in _TORCH_TO_WIRE.items()}


def host_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Any device's tensor -> a contiguous host tensor in `dtype` (`t` itself when it already is
    one: no copy, no dispatch).

    The single device->host crossing every backend shares (`stage_to_host` is built on it; the
    ring's same-host path copies from it straight into shared memory).
    """
    if t.dtype == dtype and t.is_cpu and t.is_contiguous():
        return t.detach() if t.requires_grad else t
    return t.detach().to(device="cpu", dtype=dtype).contiguous()


def stage_to_host(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Any device's tensor -> a flat, contiguous host array in `dtype` (aliases `t` when it
    already is one), through `host_tensor`."""
    return host_tensor(t, dtype).numpy().reshape(-1)


def to_caller(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host tensor -> `like`'s device and dtype (host -> device; `out` itself when it already
    is there)."""
    if like.dtype == out.dtype and like.device.type == "cpu":
        return out
    return out.to(device=like.device, dtype=like.dtype)


def unstage(host: np.ndarray, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A host array -> a tensor of `shape` on `like`'s device in `like`'s dtype (host -> device)."""
    return to_caller(torch.from_numpy(host.reshape(shape)), like)


def wire_dtype_for(t: torch.Tensor, float_wire: wd.WireDtype) -> wd.WireDtype:
    """The dtype `t` travels in: the negotiated float wire for floats, its own type for integers."""
    if t.dtype.is_floating_point:
        return float_wire
    try:
        return _TORCH_TO_WIRE[t.dtype]
    except KeyError:
        raise WireDtypeError(f"dtype {t.dtype} has no wire encoding") from None


def torch_dtype(wire: wd.WireDtype) -> torch.dtype:
    """The torch dtype a payload of `wire` decodes to."""
    return _WIRE_TO_TORCH[wire.code]


def np_dtype(wire: wd.WireDtype) -> np.dtype:
    """The numpy dtype of a payload buffer of `wire` (bfloat16 is carried as raw uint16 words)."""
    return _NP[wire.name]


def encode_f32(x: np.ndarray, wire: wd.WireDtype) -> np.ndarray:
    """float32 host values -> the payload array in `wire` (no copy when the wire is float32)."""
    if wire.code == wd.FLOAT32.code:
        return x
    if wire.code == wd.FLOAT16.code:
        return x.astype(_NP["float16"])
    if wire.code == wd.BFLOAT16.code:
        return (
            torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(_NP["bfloat16"])
        )
    raise WireDtypeError(f"{wire.name} is not a float wire dtype")


def decode_f32(payload: np.ndarray, wire: wd.WireDtype) -> np.ndarray:
    """A payload array in `wire` -> float32 host values (no copy when the wire is float32)."""
    if wire.code == wd.FLOAT32.code:
        return payload
    if wire.code == wd.FLOAT16.code:
        return payload.astype(_NP["float32"])
    if wire.code == wd.BFLOAT16.code:
        words = torch.from_numpy(payload.view(np.int16))
        return words.view(torch.bfloat16).to(torch.float32).numpy()
    raise WireDtypeError(f"{wire.name} is not a float wire dtype")


def quantize(x: np.ndarray, wire: wd.WireDtype) -> np.ndarray:
    """x rounded through the wire dtype (identity for float32): what a receiver will see of x."""
    if wire.code == wd.FLOAT32.code:
        return x
    return decode_f32(encode_f32(x, wire), wire)


def encode_tensor(t: torch.Tensor, float_wire: wd.WireDtype) -> tuple[wd.WireDtype, np.ndarray]:
    """A tensor on any device -> (its wire dtype, a flat payload array): floats via float32 to the
    wire dtype, integers as themselves. The point-to-point channels' encoder."""
    wire = wire_dtype_for(t, float_wire)
    if t.dtype.is_floating_point:
        return wire, encode_f32(stage_to_host(t, torch.float32), wire)
    return wire, stage_to_host(t, t.dtype)


def decode_tensor(
    payload: np.ndarray,
    wire: wd.WireDtype,
    shape: tuple[int, ...],
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A flat payload array of `wire` -> a tensor of `shape` in `dtype` (default: the wire's own
    type, float32 for the float wires) on `device`."""
    if wire.reducible:
        host = decode_f32(payload, wire)
        target = dtype or torch.float32
    else:
        host = payload
        target = dtype or torch_dtype(wire)
    return torch.from_numpy(host).reshape(shape).to(device=device, dtype=target)
