"""The C structs the kernels take (csrc/quant.h, csrc/decode_layers.h, csrc/decode_token.c), declared once for ctypes
and torch-free: the torch modules (quant.py, decode_layer.py, decode_model.py) and the torch-free
single-node path (`tandem.kernels.lean`) fill the same types."""

from __future__ import annotations

import ctypes


class TqPart(ctypes.Structure):  # csrc/quant.h tq_part: one row-stacked weight of a layer
    _fields_ = (("w", ctypes.c_void_p), ("rows", ctypes.c_int64), ("type", ctypes.c_int64))


class TqLinear(ctypes.Structure):  # csrc/quant.h tq_linear: a dense weight, or GGUF parts
    _fields_ = (
        ("w", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("parts", ctypes.c_void_p),
        ("nparts", ctypes.c_int64),
    )


class TqMoeAct(ctypes.Structure):  # csrc/quant.h tq_moe_act: gpt-oss's expert activation
    _fields_ = (
        ("gate_bias", ctypes.c_void_p),
        ("up_bias", ctypes.c_void_p),
        ("down_bias", ctypes.c_void_p),
        ("kind", ctypes.c_int64),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
    )


class TqMoeShared(ctypes.Structure):  # csrc/decode_layers.h tq_moe_shared: a gated shared expert
    _fields_ = (
        ("gate_up", ctypes.c_void_p),  # TqLinear (2W, D)
        ("down", ctypes.c_void_p),  # TqLinear (D, W)
        ("gate", ctypes.c_void_p),  # TqLinear (1, D)
        ("W", ctypes.c_int64),
    )


class TqMoeLayer(ctypes.Structure):  # csrc/decode_layers.h tq_moe_layer: a sparse feed-forward
    _fields_ = (
        ("router", ctypes.c_void_p),  # TqLinear
        ("E", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("route", ctypes.c_int64),  # 0 softmax_topk, 1 topk_softmax
        ("normalize", ctypes.c_int64),
        ("W", ctypes.c_int64),
        ("gate", ctypes.c_void_p),
        ("up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("gate_type", ctypes.c_int64),
        ("up_type", ctypes.c_int64),
        ("down_type", ctypes.c_int64),
        ("act", ctypes.c_void_p),  # TqMoeAct or NULL
        ("shared", ctypes.c_void_p),  # TqMoeShared or NULL
    )


class TqLayer(ctypes.Structure):  # csrc/decode_layers.h tq_layer: one decoder layer's arguments
    _fields_ = (
        ("in_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("in_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        ("qk_eps", ctypes.c_float),
        ("qkv", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("rope_pairs", ctypes.c_int),  # 0 HF halves, 1 llama.cpp's pairs (csrc tandem_norm_rope)
        # zero for a plain dense layer (the torch path's): the attention's window (0 all keys)
        # and sinks (float32 (H) or NULL), Gemma's sandwich norms of the two halves' outputs,
        # the MLP's activation (0 silu, 1 gelu_tanh), the local RoPE table, a TqMoeLayer
        ("window", ctypes.c_int64),
        ("sinks", ctypes.c_void_p),
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("act", ctypes.c_int64),
        ("rope_local", ctypes.c_int64),
        ("moe", ctypes.c_void_p),
    )


class TqDecodePlan(ctypes.Structure):  # csrc/decode_token.c tq_decode_plan: a token's fixed part
    _fields_ = (
        ("layers", ctypes.c_void_p),  # TqLayer[n_layers]
        ("n_layers", ctypes.c_int64),
        ("slot_stride", ctypes.c_int64),  # elements between two slots of a layer's cache
        ("kv_strides", ctypes.c_void_p),  # int64[2]: between kv heads, between positions
        ("D", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("G", ctypes.c_int64),
        ("hd", ctypes.c_int64),
        ("I", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("norm_w", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("head", ctypes.c_void_p),  # TqLinear
        ("vocab", ctypes.c_int64),
        ("embed", ctypes.c_void_p),
        ("embed_type", ctypes.c_int64),
        ("embed_rows", ctypes.c_int64),
        ("embed_row_bytes", ctypes.c_int64),
        ("h", ctypes.c_void_p),  # float32 (D): the residual stream
        ("hn", ctypes.c_void_p),  # float32 (D): its normed copy, the head's input
        ("scratch", ctypes.c_void_p),  # float32 (D)
        ("nthreads", ctypes.c_int),
        ("embed_scale", ctypes.c_float),  # the embedding row's scale (Gemma), 0: none
    )
