"""A model's decoder layers for one decode token in one native call (csrc/decode_model.c): each
layer's two halves (decode_layer.py's calls) and the residual adds, chained in C from the first
held layer to the last. Per layer the per-layer path pays ~60 us of Python (module dispatch, the
eligibility checks, ctypes argument conversion); on a small, deep model that is a large share of
the token (SmolLM2-135M: 30 layers of ~2.2 MB of Q4_1 weights each).

The layer-fixed arguments (norm weights, the projections' tq_linear descriptors, the cache
tensors) are gathered once into a `Plan` (one C struct per layer) kept on the model; a step then
checks only what varies per step (one sequence, one token, a cache and no mask, the write block:
decode_layer.eligible's step conditions) and makes one call. The plan is made the first time a
model's layers are all eligible (decode_layer.eligible's module conditions) and again when the
step's KV cache is another tensor set; a model whose layers are not all eligible gets None and
keeps the per-layer path. The modules are fixed once `kernels.prepare` has run (the per-layer
path caches its descriptors on the same assumption).

The result equals the per-layer path's bit for bit: the same C functions in the same order, and
the residual `h + a` rounded once to the activations' dtype as PyTorch rounds it
(tests/unit/test_decode_model.py).
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from tandem.kernels import decode_layer, native
from tandem.kernels.cstructs import TqLayer as _Layer
from tandem.kernels.fast_attention import FastAttention
from tandem.models.context import ForwardContext


class Plan:
    """The C arguments of one model's layers over one KV cache (module docstring)."""

    def __init__(self, layers: list, cache, dtype: torch.dtype) -> None:
        attn0, mlp0 = layers[0].self_attn, layers[0].mlp
        self.cache, self.dtype = weakref.ref(cache), dtype  # a closed executor's cache may go
        self.D = layers[0].input_layernorm.weight.shape[0]
        self.H, self.G, self.hd = attn0.n_heads, attn0.n_kv_heads, attn0.head_dim
        self.I = mlp0.down_proj.in_features
        self.scale = self.hd**-0.5
        self.code = native.DTYPE_CODES[dtype]
        k0 = cache.k[attn0.layer_idx]  # (slots, G, max_seq, hd)
        self.slot_stride = k0.stride(0)
        self.kv_strides = (ctypes.c_int64 * 2)(k0.stride(1), k0.stride(2))
        self.keep = []  # the descriptors the structs point to
        self.array = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            k, v = cache.k[attn.layer_idx], cache.v[attn.layer_idx]
            same = (attn.n_heads, attn.n_kv_heads, attn.head_dim, mlp.down_proj.in_features)
            if same != (self.H, self.G, self.hd, self.I) or k.shape != k0.shape:
                raise native.NativeError("the layers differ in shape")
            if k.stride() != k0.stride() or v.stride() != k0.stride() or k.dtype != dtype:
                raise native.NativeError("the layers' k and v caches differ in layout")
            descs = [
                decode_layer._desc(p)
                for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            self.keep.extend(descs)
            qn, kn = attn.q_norm, attn.k_norm
            self.array[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                layer.input_layernorm.eps,
                layer.post_attention_layernorm.eps,
                0.0 if qn is None else qn.eps,
                *(ctypes.addressof(d) for d in descs),
                None if qn is None else qn.weight.data_ptr(),
                None if kn is None else kn.weight.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
            )
        self.ptrs = _cache_ptrs(layers, cache)

    def fits(self, layers: list, cache) -> bool:
        """This plan was made for `cache` as it is now."""
        return cache is self.cache() and _cache_ptrs(layers, cache) == self.ptrs


def _cache_ptrs(layers: list, cache) -> tuple[int, ...]:
    return tuple(cache.k[la.self_attn.layer_idx].data_ptr() for la in layers[:1] + layers[-1:])


def _eligible_step(h: torch.Tensor, ctx: ForwardContext) -> bool:
    return (
        h.dim() == 2
        and h.shape[0] == 1
        and ctx.cache is not None
        and ctx.attn_mask is None
        and not ctx.is_causal
        and ctx.write_block is not None
        and h.is_contiguous()
        and ctx.cos.dtype == h.dtype
    )


def plan(model, layers: list, h: torch.Tensor, ctx: ForwardContext) -> Plan | None:
    """The model's plan for this step's cache, made or remade as needed, or None where a layer
    is not eligible (module docstring). The caller has checked the step (`run` does)."""
    p = model.__dict__.get("_decode_plan")
    if p is False or not layers:  # a layer was found ineligible: the modules do not change
        return None
    if p is not None and p.dtype == h.dtype and p.fits(layers, ctx.cache):
        return p
    ok = all(
        isinstance(getattr(la, "self_attn", None), FastAttention)
        and decode_layer.eligible(la, h, ctx)
        for la in layers
    )
    try:
        p = Plan(layers, ctx.cache, h.dtype) if ok else None
    except native.NativeError:
        p = None
    model.__dict__["_decode_plan"] = p if p is not None else False
    return p


def run(model, layers: list, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
    """h (1, D) -> the output of `layers` (1, D), this token's k/v written into every layer's
    cache; None (nothing run) where the one-call path does not apply, and the caller runs the
    layers one by one."""
    if not (_eligible_step(h, ctx) and native.handles(h)):
        return None
    p = plan(model, layers, h, ctx)
    if p is None:
        return None
    slot, _, pos, _ = ctx.write_block
    out = h.clone()
    rc = native.library().tandem_decode_layers(
        ctypes.addressof(p.array), len(p.array), out.data_ptr(), ctx.cos.data_ptr(),
        ctx.sin.data_ptr(), None, None, slot, p.slot_stride, p.kv_strides, pos, p.D, p.H, p.G, p.hd, p.I,
        p.scale, p.code, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise native.NativeError("the native decode layers refused their arguments")
    return out
