"""A decoder layer for one decode token in two native calls (csrc/decode_block.c): the attention
half and the MLP half, each chaining the native ops in C. At batch 1 the Python between the
per-op calls (module dispatch, wrappers, cache slicing) ran with caches the weight streams had just
evicted and cost 10-15 ms of a ~55 ms bf16 Qwen3-0.6B token; here it is two calls per layer.

Taken only where it computes exactly what the per-op path computes: one sequence and one new
token (B*T == 1) with a cache and no mask (`ctx.write_block` gives its slot and position), on a
layer whose q/k/v and gate/up are fused and whose four projections run a native kernel (the dense
GEMV on weights of the compute dtype, or the quantized GEMV on GGUF blocks: each projection is
passed as a csrc/quant.h `tq_linear`), on the CPU. Anything else returns None and the caller takes
the per-op path.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels import native
from tandem.kernels.cstructs import TqLinear as _Linear
from tandem.kernels.linear import NATIVE, KernelLinear
from tandem.kernels.quant_linear import QuantKernelLinear
from tandem.models.context import ForwardContext
from tandem.models.llama import DecoderLayer


def _native_linear(m, dtype: torch.dtype) -> bool:
    if isinstance(m, QuantKernelLinear):
        return True
    return isinstance(m, KernelLinear) and m.kernel == NATIVE and m.weight.dtype == dtype


def _desc(m) -> _Linear:
    """The tq_linear of a native projection, made once per module (its tensors are fixed)."""
    d = m.__dict__.get("_decode_desc")
    if d is None:
        b = _ptr(m._bias32)
        if isinstance(m, QuantKernelLinear):
            arr = m.parts.array
            d = _Linear(None, b, ctypes.addressof(arr), len(arr))
        else:
            d = _Linear(m.weight.data_ptr(), b, None, 0)
        m.__dict__["_decode_desc"] = d
    return d


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def eligible(layer, h: torch.Tensor, ctx: ForwardContext) -> bool:
    """`layer` can run this step through the native halves (module docstring)."""
    attn, mlp, dt = layer.self_attn, layer.mlp, h.dtype
    return (
        isinstance(layer, DecoderLayer)  # Llama's pre-norm layer: not Gemma's sandwich
        # the fast, fused SwiGLU and attention (a sparse layer's MoE block runs on its own,
        # Gemma's GELU-tanh MLP and attention on the reference math)
        and getattr(mlp, "gate_up_proj", None) is not None
        and getattr(attn, "qkv_proj", None) is not None
        and h.dim() == 2
        and h.shape[0] == 1
        and ctx.cache is not None
        and ctx.attn_mask is None
        and attn.sinks is None  # gpt-oss's sinks and windows keep the per-module path
        and attn.window is None
        and not ctx.is_causal
        and ctx.write_block is not None
        and native.handles(h)
        and h.is_contiguous()
        and ctx.cos.dtype == dt
        and ctx.cos.shape[-1] == attn.head_dim  # partial rotary keeps the per-module path
        and _native_linear(attn.qkv_proj, dt)
        and _native_linear(attn.o_proj, dt)
        and _native_linear(mlp.gate_up_proj, dt)
        and _native_linear(mlp.down_proj, dt)
        and layer.input_layernorm.weight.dtype == dt
        and layer.post_attention_layernorm.weight.dtype == dt
        and (attn.q_norm is None or attn.q_norm.weight.dtype == dt)
    )


def run(layer, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """h (1, D) -> the layer's output (1, D), this token's k/v written into the cache. The caller
    has checked `eligible`."""
    attn, mlp = layer.self_attn, layer.mlp
    lib = native.library()
    code, threads = native.DTYPE_CODES[h.dtype], torch.get_num_threads()
    D = h.shape[1]
    slot, _, pos, _ = ctx.write_block
    k_all, v_all = ctx.cache.k[attn.layer_idx], ctx.cache.v[attn.layer_idx]
    k, v = k_all[slot], v_all[slot]  # (G, max_seq, hd): this sequence's cache
    strides = (ctypes.c_int64 * 2)(k.stride(0), k.stride(1))
    if v.stride()[:2] != k.stride()[:2]:
        raise native.NativeError("the k and v caches differ in layout")
    qn, kn = attn.q_norm, attn.k_norm
    a = torch.empty_like(h)
    rc = lib.tandem_attention_block(
        h.data_ptr(), layer.input_layernorm.weight.data_ptr(), layer.input_layernorm.eps,
        ctypes.byref(_desc(attn.qkv_proj)),
        _ptr(None if qn is None else qn.weight), _ptr(None if kn is None else kn.weight),
        0.0 if qn is None else qn.eps, ctx.cos.data_ptr(), ctx.sin.data_ptr(), 0,
        k.data_ptr(), v.data_ptr(), strides, pos, ctypes.byref(_desc(attn.o_proj)), a.data_ptr(),
        D, attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.head_dim**-0.5, code, threads,
    )  # fmt: skip
    if rc != 0:
        raise native.NativeError("the native attention block refused its arguments")
    h = h + a
    norm = layer.post_attention_layernorm
    m = torch.empty_like(h)
    rc = lib.tandem_mlp_block(
        h.data_ptr(), norm.weight.data_ptr(), norm.eps, ctypes.byref(_desc(mlp.gate_up_proj)),
        ctypes.byref(_desc(mlp.down_proj)), m.data_ptr(), D, mlp.down_proj.in_features, code,
        threads,
    )  # fmt: skip
    if rc != 0:
        raise native.NativeError("the native MLP block refused its arguments")
    return h + m
