"""`LeanModel`: a Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / Mixtral / gpt-oss / Gemma 3 /
Phi-3 / Qwen3.5 (dense or MoE) model's forward pass without torch, over GGUF blocks as stored. The same math as the
reference model (`tandem.models.llama`) in float32:

    x = embed(ids)                                           (N, D), N new tokens of the step
    per layer:  h = rmsnorm(x);  q, k, v = split(h Wqkv^T + b)
                q, k = rope(qk_norm(q), qk_norm(k))          k, v written at their positions
                x = x + attend(q, K, V) Wo^T + b_o           causal; grouped-query (H / G)
                x = x + (silu(g) * u)(rmsnorm(x) Wgu^T) Wdown^T      (a dense layer)
                x = x + moe(rmsnorm(x))                      (a sparse layer: `lean.moe`,
                                                              its shared expert included)
    logits = rmsnorm(x_last) Whead^T                         (B, V), one row per sequence

`attend` at position p sees keys 0..p, or on a layer with a sliding window w (`config.window`:
Mistral's every layer, gpt-oss's alternate ones) keys max(0, p - w + 1)..p; with attention sinks
(gpt-oss) head h's learned logit s_h joins its softmax without a value:
softmax([z_0..z_p, s_h])[:-1] . V. RoPE's tables are YaRN's or longrope's where the model states
it (cos and sin times its attention factor, `rope.attention_factor`; longrope's short or long set
by each row's sequence length, `rope.Tables`).

Phi-3's blocks (`models.families.phi3`): the file's fused attn_qkv and ffn_up are read as the
row ranges of q, k, v and gate, up (views, no copy); partial rotary keeps each q/k head in
`rope.partial_order` (the q and k rows, their biases and q/k norms permuted once at load: a copy
of the q and k weights only), so the native calls rotate the whole head with cos 1 and sin 0 on
the pass-through dims.

Gemma 3's blocks (`models.gemma`): x = embed(ids) * embed_scale; every norm (offset + w) * x / rms
(the offset added to w once, in float32); four norms a layer (sandwich):
x = x + post_attn_norm(attend(...) Wo^T), x = x + post_ffn_norm(mlp(pre_ffn_norm(x))); the MLP
gelu_tanh(g) * u; scores scaled by query_pre_attn_scalar^-1/2; its windowed layers rotate by their
own unscaled table (`rope_local_theta`).

The Qwen3.5 hybrid's blocks (`qwen35`, and `qwen35moe` whose every FFN is the MoE block with
its sigmoid-gated shared expert; `models.qwen35`): on its linear layers a Gated
DeltaNet mixer in place of attention (`lean.deltanet`: x = x + mixer(x), its input norm inside,
each slot's conv window and matrices held in `conv` / `ssm`, zeroed for a row from position 0);
on the others gated attention: q_proj gives per head hd query rows then hd gate rows, and
x = x + o_proj(attend(...) * sigmoid(gate)), partial rotary reordering the query rows only. Its
decode runs `forward_steps` (each DeltaNet layer one native call for one row of one token).

The projections run csrc/qgemv.c on the mapped blocks (`linear.Linear`); the norms, RoPE,
SwiGLU, Gemma's GeGLU and the causal attention the csrc/decode_ops.c calls, so no BLAS runs
(numpy's OpenBLAS threads would spin against the kernels' OpenMP threads). One sequence with one
new token takes the one-call decode (csrc/decode_model.c: every layer in C, as the torch path's
FastTransformer), every architecture above: a layer there carries its window, its sinks, its
sandwich norms, its activation, its RoPE table and its MoE block (csrc/moe.c, a shared expert
included) where it has them.
`_decode_layers` is the same token layer by layer, two calls each (the attention half, then the
MoE block or the dense MLP half), the reference the one call equals bit for bit
(tests/unit/test_decode_token.py).

The KV cache is float32 (layers, slots, kv heads, max_seq_len, head_dim), zeroed lazily by the
OS: a page is resident once a token is written into it. Its slots share a copied prefix's
physical pages (`models.kv_pages`; `kv_arrays`).

A `llama` file's q/k rows are used in the order llama.cpp's converter stored them (`qk_pairs`):
within each head, HF element j of the first half at 2j and of the second half at 2j + 1. RoPE
then rotates adjacent pairs (csrc tandem_norm_rope's `pairs`), which gives each q and k element
the value the HF order gives it, at its stored place; the cached keys are in that order too, and
a score q.k is the same sum in another order. So no un-permuted copy of q/k is made (8 MB on
SmolLM2-135M, ~380 MB on a Llama-3-8B Q4_K_M); v, and so every attention output, is untouched.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tandem.config import ModelConfig
from tandem.kernels import library, variant_choice
from tandem.kernels.cstructs import TqLayer
from tandem.kernels.lean import ops
from tandem.kernels.lean.deltanet import DeltaNetMixer
from tandem.kernels.lean.linear import LeanWeightError, Linear
from tandem.kernels.lean.moe import MoEBlock
from tandem.kernels.lean.rope import Tables, partial_order
from tandem.kernels.lean.token import DecodeToken
from tandem.models.kv_pages import KVPages, KVPagesUnavailable, warn_unavailable
from tandem.models.quant.values import as_float32


class LeanUnsupportedError(ops.LeanKernelError):
    """A model the torch-free path does not run (the caller takes the torch path instead)."""


class WeightSource(Protocol):
    """What `LeanModel` reads (`loaders.gguf.model_file.GGUFModel` is one)."""

    config: ModelConfig
    qk_pairs: bool  # q/k rows stored in llama.cpp's RoPE pair order (module docstring)

    def info(self, name: str): ...  # .type_id

    def block_array(self, name: str, as_stored: bool = False) -> np.ndarray: ...

    def values_array(self, name: str, as_stored: bool = False) -> np.ndarray: ...


class Layer:
    """One decoder layer's weights: norms float32, fused q/k/v and gate/up projections; q/k rows
    in the file's order (module docstring)."""

    def __init__(self, src: WeightSource, i: int) -> None:
        c = src.config
        p = f"model.layers.{i}."
        D = c.hidden_size
        # partial rotary: each q/k head's rows in rope.partial_order (module docstring)
        order = None if c.rotary_dim == c.head_dim else partial_order(c.head_dim, c.rotary_dim)

        def heads(a: np.ndarray, n: str) -> np.ndarray:
            """q/k rows (heads hd, ...) -> each head's rows in `order` (a copy); others as are.
            A gated q_proj (Qwen3.5: per head hd query rows, then hd gate rows) reorders only
            its query rows."""
            if order is None or not n.startswith(("self_attn.q_", "self_attn.k_")):
                return a
            hd = c.head_dim
            if c.attn_output_gate and n.startswith("self_attn.q_proj"):
                g = a.reshape(-1, 2, hd, *a.shape[1:]).copy()  # (H, query / gate, hd, ...)
                g[:, 0] = g[:, 0][:, order]
                return np.ascontiguousarray(g.reshape(a.shape))
            return np.ascontiguousarray(a.reshape(-1, hd, *a.shape[1:])[:, order].reshape(a.shape))

        def parts(*names: str) -> list[tuple[np.ndarray, int]]:
            return [
                (heads(src.block_array(p + n, as_stored=True), n), src.info(p + n).type_id)
                for n in names
            ]

        def bias(on: bool, *names: str) -> np.ndarray | None:
            if not on:
                return None
            return np.concatenate(
                [heads(src.values_array(p + n, as_stored=True), n) for n in names]
            )

        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        gu = ("mlp.gate_proj", "mlp.up_proj")
        self.in_norm = _norm(src, p + "input_layernorm.weight", c)
        # a hybrid's DeltaNet layer (`lean.deltanet`) in place of attention; gated attention
        # (Qwen3.5) has 2 H hd q rows: per head the query, then its output gate
        self.deltanet = DeltaNetMixer(src, i, c, self.in_norm) if c.is_linear(i) else None
        self.q_rows = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
        # sandwich (Gemma): post_attention_layernorm normalizes the attention's output and
        # pre_feedforward_layernorm the MLP's input; else the former is the MLP's input norm
        self.attn_out_norm = self.mlp_out_norm = None
        if c.norm_placement == "sandwich":
            self.attn_out_norm = _norm(src, p + "post_attention_layernorm.weight", c)
            self.post_norm = _norm(src, p + "pre_feedforward_layernorm.weight", c)
            self.mlp_out_norm = _norm(src, p + "post_feedforward_layernorm.weight", c)
        else:
            self.post_norm = _norm(src, p + "post_attention_layernorm.weight", c)
        self.q_norm = self.k_norm = None  # (hd,), one per head shared by all heads
        if c.qk_norm and self.deltanet is None:
            self.q_norm, self.k_norm = (
                heads(_norm(src, p + f"self_attn.{x}_norm.weight", c), f"self_attn.{x}_")
                for x in ("q", "k")
            )
        self.window = c.window(i) or 0  # 0: every earlier key
        self.sinks = _vec(src, p + "self_attn.sinks") if c.attn_sinks else None  # (H,)
        self.rope_local = c.rope_local(i)  # this layer rotates by the local (windowed) table
        self.qkv = self.o = None
        if self.deltanet is None:
            self.qkv = Linear(
                parts(*(n + ".weight" for n in qkv)),
                D,
                bias(c.qkv_bias, *(n + ".bias" for n in qkv)),
                p + "qkv",
            )
            self.o = Linear(
                parts("self_attn.o_proj.weight"), c.num_attention_heads * c.head_dim,
                bias(c.o_bias, "self_attn.o_proj.bias"), p + "o_proj",
            )  # fmt: skip
        self.moe = self.gate_up = self.down = None
        if c.is_sparse(i):
            self.moe = MoEBlock(src, i, self.post_norm)
            return
        self.gate_up = Linear(
            parts(*(n + ".weight" for n in gu)),
            D,
            bias(c.mlp_bias, *(n + ".bias" for n in gu)),
            p + "gate_up",
        )
        self.down = Linear(
            parts("mlp.down_proj.weight"), c.intermediate_size, bias(c.mlp_bias, "mlp.down_proj.bias"),
            p + "down_proj",
        )  # fmt: skip


def _mixer_projections(L) -> list[Linear]:
    """A layer's token-mixer projections: q/k/v and o, or a DeltaNet's in and out."""
    if L.deltanet is not None:
        return [L.deltanet.inp, L.deltanet.out]
    return [L.qkv, L.o]


def _sparse_projections(L) -> list[Linear]:
    """A sparse layer's projections every token runs: the router and a shared expert's."""
    if L.moe is None:
        return []
    s = L.moe.shared
    return [L.moe.router] + ([] if s is None else [s.gate_up, s.down, s.gate])


def _vec(src: WeightSource, name: str) -> np.ndarray:
    return np.ascontiguousarray(src.values_array(name), dtype=np.float32)


def _norm(src: WeightSource, name: str, c: ModelConfig) -> np.ndarray:
    """A norm's weight as the C RMSNorm multiplies it: w, or Gemma's offset + w in float32."""
    w = _vec(src, name)
    if c.norm_weight_offset is None:
        return w
    return np.ascontiguousarray(np.float32(c.norm_weight_offset) + w, dtype=np.float32)


def check_supported(config: ModelConfig) -> None:
    """Raises LeanUnsupportedError for a model shape this path lacks."""
    # the MoE call norms its input by the weight it holds, so a (1 + w) norm folded into that
    # weight (the Qwen3.5 hybrid's) is no difference to it; Gemma's others are
    if config.moe is not None and is_gemma(dataclasses.replace(config, norm_weight_offset=None)):
        raise LeanUnsupportedError("Gemma's blocks with experts (the torch path runs them)")
    if config.head_dim % 2:  # RoPE pairs halves; ModelConfig bounds it by csrc's 1024
        raise LeanUnsupportedError(f"an odd head_dim {config.head_dim}")


def is_gemma(config: ModelConfig) -> bool:
    """Whether `config` has any of Gemma's block differences (module docstring)."""
    return (
        (config.norm_placement, config.norm_weight_offset, config.mlp_activation)
        != ("pre", None, "silu")
        or config.embed_scale is not None
        or config.query_pre_attn_scalar is not None
        or config.rope_local_theta is not None
    )


class LeanModel:
    """The whole model over `src`'s blocks, a KV cache of `slots` sequences of `max_seq_len`,
    `threads` threads in every native call (module docstring)."""

    def __init__(self, src: WeightSource, slots: int, max_seq_len: int, threads: int) -> None:
        if not library.available():
            raise LeanUnsupportedError(f"the native kernels are unavailable: {library.why()}")
        c = self.config = src.config
        check_supported(c)
        self.threads = threads
        self.D, self.H, self.G, self.hd = (
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        )  # fmt: skip
        self.eps = c.rms_norm_eps
        self.pairs = src.qk_pairs
        if self.pairs and c.qk_norm:  # no architecture has both (llama pairs, qwen3 norms)
            raise LeanUnsupportedError("q/k norms on q/k rows in llama.cpp's pair order")
        if self.pairs and c.rotary_dim != c.head_dim:  # nor both of these (llama, phi3)
            raise LeanUnsupportedError("partial rotary on q/k rows in llama.cpp's pair order")
        try:
            self.layers = [Layer(src, i) for i in range(c.num_hidden_layers)]
            embed = "model.embed_tokens.weight"
            self.embed_blocks, self.embed_type = src.block_array(embed), src.info(embed).type_id
            head = embed if c.tie_word_embeddings else "lm_head.weight"
            self.head = Linear(
                [(src.block_array(head), src.info(head).type_id)], self.D, None, head
            )
        except LeanWeightError as e:
            raise LeanUnsupportedError(str(e)) from None
        # every Q8_0 projection repacked for the GEMV (tandem/kernels/repack.py), the mapped
        # file's pages released; the embedding reads its rows from the file as stored
        done: dict[int, np.ndarray] = {}
        for lin in self.projections():
            lin.repack_q8_0(done, threads)
        self.norm = _vec(src, "model.norm.weight")
        self.rope = Tables(c, self.pairs)
        self.local_rope = None  # the windowed layers' own table (Gemma 3), unscaled
        if c.rope_local_theta is not None:
            local = dataclasses.replace(
                c, rope_theta=c.rope_local_theta, rope_scaling=None, rope_freq_factors=None
            )
            self.local_rope = Tables(local, self.pairs)
        self.scale = c.attention_scale
        self.gemma = c.mlp_activation == "gelu_tanh"  # the dense MLP's GeGLU (else SwiGLU)
        self.max_seq_len = max_seq_len
        self.pages, self.k, self.v = kv_arrays(
            c.num_hidden_layers, slots, self.G, max_seq_len, self.hd
        )
        # a hybrid's DeltaNet layers: each slot's conv window and matrices (`lean.deltanet`)
        self.conv: dict[int, np.ndarray] = {}  # layer -> (slots, C, K - 1)
        self.ssm: dict[int, np.ndarray] = {}  # layer -> (slots, Hv, dk, dv)
        for i, L in enumerate(self.layers):
            if L.deltanet is not None:
                w, st = L.deltanet.state_shapes()
                self.conv[i] = np.zeros((slots, *w), np.float32)
                self.ssm[i] = np.zeros((slots, *st), np.float32)
        # one decode token in one native call, embedding to argmax; the hybrid's DeltaNet and
        # gated attention are not in the C layer table: it decodes op by op (`forward_steps`),
        # each DeltaNet layer one native call
        self.hybrid = c.deltanet is not None
        self._decode = None if self.hybrid else self._decode_plan()
        self.decode_token = None if self.hybrid else DecodeToken(self)
        # each weight type multiplied by the ISA build that timed fastest on these weights
        self.kernel_choice = variant_choice.choose(self.projections(), threads)

    # ---- the pieces -----------------------------------------------------------------------

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids (N,) -> their embedding rows (N, D) float32 (quantized rows dequantized as gguf-py
        does, which the torch path's dequantization equals bit for bit)."""
        rows = self.embed_blocks[ids]  # (N, row_bytes), a copy of those rows only
        return np.ascontiguousarray(as_float32(rows, self.embed_type))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot `dst` takes slot `src`'s first `n` positions of every layer's keys and values:
        k[:, dst, :, :n] = k[:, src, :, :n] (L, G, n, hd), v alike: the whole blocks of
        positions 0..m-1 by mapping the source's pages (`pages.share`, no byte copied), the
        rest m..n-1 copied. Positions >= n of `dst` are written by its next step before any row
        reads them."""
        m = self.pages.share(src, dst, n) if self.pages is not None else 0
        # a hybrid's DeltaNet layers hold no keys (their KV pages stay untouched) but a state:
        # n is then the whole sequence (`SequenceCache` refuses a partial copy)
        att = (
            [i for i, L in enumerate(self.layers) if L.deltanet is None]
            if self.conv
            else slice(None)
        )
        self.k[att, dst, :, m:n] = self.k[att, src, :, m:n]
        self.v[att, dst, :, m:n] = self.v[att, src, :, m:n]
        for held in (*self.conv.values(), *self.ssm.values()):
            held[dst] = held[src]

    # ---- the forward pass -----------------------------------------------------------------

    def forward(self, rows: Sequence[tuple[int, int, Sequence[int]]]) -> np.ndarray:
        """rows [(slot, start_pos, token_ids), ...] -> the final hidden state at each row's last
        token (B, D), normed: each row's tokens written into its slot's cache from start_pos on."""
        if len(rows) == 1 and len(rows[0][2]) == 1 and not self.hybrid:
            slot, pos, ids = rows[0]
            return self._decode_one(slot, pos, ids[0])
        return self.forward_steps(rows)

    def forward_steps(self, rows: Sequence[tuple[int, int, Sequence[int]]]) -> np.ndarray:
        """`forward` op by op, every row's tokens together through each layer (a prefill's and
        a batch's path; a single token's reference)."""
        H, G, hd, th = self.H, self.G, self.hd, self.threads
        ids = np.fromiter((t for _, _, tok in rows for t in tok), np.int64)
        pos = np.concatenate([np.arange(p, p + len(tok)) for _, p, tok in rows])
        ends = np.concatenate([np.full(len(tok), p + len(tok)) for _, p, tok in rows])
        cos, sin = self.rope.rows(pos, ends)  # (N, hd) each
        local = None if self.local_rope is None else self.local_rope.rows(pos, ends)
        x = self.embed(ids)  # (N, D)
        if self.config.embed_scale is not None:
            x = x * np.float32(self.config.embed_scale)
        bounds = np.cumsum([0] + [len(tok) for _, _, tok in rows])
        for li, L in enumerate(self.layers):
            if L.deltanet is not None:
                x = x + self._deltanet(li, L, x, rows, bounds)
                x = x + self._mlp(L, x)
                continue
            h = ops.rmsnorm(x, L.in_norm, self.eps, th)
            qkv = L.qkv(h, th)  # (N, (H + 2G) hd), or (N, (2H + 2G) hd) gated
            qr = L.q_rows
            q, k, v = qkv[:, :qr], qkv[:, qr : qr + G * hd], qkv[:, qr + G * hd :]
            gate = None
            if qr != H * hd:  # per head the query rows, then the gate's
                qg = q.reshape(-1, H, 2, hd)
                q, gate = (np.ascontiguousarray(qg[:, :, j].reshape(-1, H * hd)) for j in (0, 1))
            c_, s_ = local if L.rope_local else (cos, sin)
            ops.norm_rope_(q, H, L.q_norm, self.eps, c_, s_, th, self.pairs)
            ops.norm_rope_(k, G, L.k_norm, self.eps, c_, s_, th, self.pairs)
            attn = np.empty((len(ids), H * hd), np.float32)
            for (slot, p, tok), r0, r1 in zip(rows, bounds[:-1], bounds[1:]):
                n = len(tok)
                kc, vc = self.k[li, slot], self.v[li, slot]  # (G, S, hd)
                kc[:, p : p + n] = k[r0:r1].reshape(n, G, hd).transpose(1, 0, 2)
                vc[:, p : p + n] = v[r0:r1].reshape(n, G, hd).transpose(1, 0, 2)
                attn[r0:r1] = ops.prefill_attention(
                    q[r0:r1], kc, vc, p, self.scale, th, L.window, L.sinks
                )
            if gate is not None:  # attn * sigmoid(gate)
                attn *= np.float32(1) / (np.float32(1) + np.exp(-gate))
            a = L.o(attn, th)
            if L.attn_out_norm is not None:
                a = ops.rmsnorm(a, L.attn_out_norm, self.eps, th)
            x = x + a
            x = x + self._mlp(L, x)
        return ops.rmsnorm(x[bounds[1:] - 1], self.norm, self.eps, th)  # (B, D)

    def _mlp(self, L: Layer, x: np.ndarray) -> np.ndarray:
        """A layer's feed-forward of x (N, D): the MoE block, or the dense MLP (Gemma's output
        norm after it)."""
        th = self.threads
        if L.moe is not None:
            return L.moe(x, th)
        gu = L.gate_up(ops.rmsnorm(x, L.post_norm, self.eps, th), th)
        act = ops.silu_mul(gu, th) if not self.gemma else ops.gelu_tanh_mul(gu, th)
        m = L.down(act, th)
        if L.mlp_out_norm is not None:
            m = ops.rmsnorm(m, L.mlp_out_norm, self.eps, th)
        return m

    def _deltanet(self, li: int, L: Layer, x: np.ndarray, rows, bounds: np.ndarray) -> np.ndarray:
        """A DeltaNet layer's mixer output (N, D) for the step's rows, each through its slot's
        conv window and matrices (zeroed for a row from position 0): one row of one token is
        one native call (`DeltaNetMixer.step`), else `DeltaNetMixer.prefill`."""
        states = []
        for slot, pos, _ in rows:
            window, state = self.conv[li][slot], self.ssm[li][slot]
            if pos == 0:  # a new sequence, or a replay: from zeros
                window.fill(0)
                state.fill(0)
            states.append((window, state))
        if len(rows) == 1 and len(rows[0][2]) == 1:
            return L.deltanet.step(np.ascontiguousarray(x), *states[0], self.threads)
        xn = ops.rmsnorm(x, L.in_norm, self.eps, self.threads)
        return L.deltanet.prefill(xn, bounds, states, self.threads)

    def projections(self) -> list[Linear]:
        """Every projection a token runs, in model order, the head last (the experts apart)."""
        lins = [
            x for L in self.layers for x in (*_mixer_projections(L), L.gate_up, L.down)
            if x is not None
        ]  # fmt: skip
        return lins + [x for L in self.layers for x in _sparse_projections(L)] + [self.head]

    def weight_arrays(self) -> list[np.ndarray]:
        """The weights one decode token reads in full, each once: every projection's blocks and
        the head's (a tied head is the embedding's table, counted once; the embedding itself reads
        one row); of a sparse layer the router and top_k experts' blocks (the first k: what any k
        chosen experts read). For the benchmarks' roofline."""
        seen, out = set(), []
        lins = [
            x for L in self.layers for x in (*_mixer_projections(L), L.gate_up, L.down)
            if x is not None
        ]  # fmt: skip
        lins += [x for L in self.layers for x in _sparse_projections(L)]
        arrays = [a for lin in lins + [self.head] for a in lin.arrays]
        arrays += [a[: L.moe.k] for L in self.layers if L.moe is not None for a in L.moe.arrays]
        for a in arrays:
            if a.ctypes.data not in seen:
                seen.add(a.ctypes.data)
                out.append(a)
        return out

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Normed hidden (B, D) -> logits (B, vocab) float32."""
        return self.head(hidden, self.threads)

    # ---- one decode token in one native call ----------------------------------------------

    def _decode_plan(self):
        layers = (TqLayer * len(self.layers))()
        for i, L in enumerate(self.layers):
            dense = L.moe is None
            layers[i] = TqLayer(
                L.in_norm.ctypes.data, L.post_norm.ctypes.data, self.eps, self.eps, self.eps,
                ctypes.addressof(L.qkv.desc), ctypes.addressof(L.o.desc),
                ctypes.addressof(L.gate_up.desc) if dense else None,
                ctypes.addressof(L.down.desc) if dense else None,
                _ptr(L.q_norm), _ptr(L.k_norm), self.k[i].ctypes.data, self.v[i].ctypes.data,
                int(self.pairs), L.window, _ptr(L.sinks), _ptr(L.attn_out_norm),
                _ptr(L.mlp_out_norm), int(self.gemma), int(L.rope_local),
                None if dense else ctypes.addressof(L.moe.desc),
            )  # fmt: skip
        es = 4
        k0 = self.k[0]  # (slots, G, S, hd)
        strides = (ctypes.c_int64 * 2)(k0.strides[1] // es, k0.strides[2] // es)
        return layers, k0.strides[0] // es, strides

    def _rope_rows(
        self, pos: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The global and (Gemma 3) local tables' cos and sin rows (1, hd) of `pos`."""
        p = np.array([pos])
        cos, sin = self.rope.rows(p)
        if self.local_rope is None:
            return cos, sin, None, None
        return (cos, sin, *self.local_rope.rows(p))

    def _embed_one(self, token: int) -> np.ndarray:
        """The token's embedding row (1, D), times Gemma's scale."""
        h = self.embed(np.array([token]))
        if self.config.embed_scale is not None:
            h = h * np.float32(self.config.embed_scale)
        return h

    def _decode_layers(self, slot: int, pos: int, token: int) -> np.ndarray:
        """One decode token layer by layer, the one-call decode's reference: the attention half
        in one call (csrc/decode_block.c, as decode_model.c chains it; the layer's window, sinks
        and RoPE table), Gemma's norm of its output, then the MoE block in one call (`lean.moe`)
        or a dense layer's MLP half in one (silu or gelu_tanh), Gemma's norm of its output."""
        lib, th, es = library.library(), self.threads, 4
        h = self._embed_one(token)  # (1, D)
        cos, sin, cos_l, sin_l = self._rope_rows(pos)
        kc0 = self.k[0, slot]  # (G, S, hd)
        strides = (ctypes.c_int64 * 2)(kc0.strides[0] // es, kc0.strides[1] // es)
        out = np.empty_like(h)
        for i, L in enumerate(self.layers):
            c_, s_ = (cos_l, sin_l) if L.rope_local else (cos, sin)
            rc = lib.tandem_attention_block_ws(
                h.ctypes.data, L.in_norm.ctypes.data, self.eps, ctypes.addressof(L.qkv.desc),
                _ptr(L.q_norm), _ptr(L.k_norm), self.eps, c_.ctypes.data, s_.ctypes.data,
                int(self.pairs), self.k[i, slot].ctypes.data, self.v[i, slot].ctypes.data,
                strides, pos, L.window, _ptr(L.sinks), ctypes.addressof(L.o.desc),
                out.ctypes.data, self.D, self.H, self.G, self.hd, self.scale, ops.F32, th,
            )  # fmt: skip
            if rc != 0:
                raise ops.LeanKernelError("the native attention block refused its arguments")
            a = out if L.attn_out_norm is None else ops.rmsnorm(out, L.attn_out_norm, self.eps, th)
            h = h + a
            if L.moe is not None:
                h = h + L.moe(h, th)
                continue
            rc = lib.tandem_mlp_block_act(
                h.ctypes.data, L.post_norm.ctypes.data, self.eps, ctypes.addressof(L.gate_up.desc),
                ctypes.addressof(L.down.desc), out.ctypes.data, self.D, L.down.in_features,
                int(self.gemma), ops.F32, th,
            )  # fmt: skip
            if rc != 0:
                raise ops.LeanKernelError("the native MLP block refused its arguments")
            m = out if L.mlp_out_norm is None else ops.rmsnorm(out, L.mlp_out_norm, self.eps, th)
            h = h + m
        return ops.rmsnorm(h, self.norm, self.eps, th)

    def _decode_one(self, slot: int, pos: int, token: int) -> np.ndarray:
        layers, slot_stride, kv_strides = self._decode
        h = self._embed_one(token)  # (1, D)
        cos, sin, cos_l, sin_l = self._rope_rows(pos)
        rc = library.library().tandem_decode_layers(
            ctypes.addressof(layers), len(layers), h.ctypes.data, cos.ctypes.data,
            sin.ctypes.data, _ptr(cos_l), _ptr(sin_l), slot, slot_stride, kv_strides, pos, self.D,
            self.H, self.G, self.hd, self.config.intermediate_size, self.scale, ops.F32,
            self.threads,
        )  # fmt: skip
        if rc != 0:
            raise ops.LeanKernelError("the native decode layers refused their arguments")
        return ops.rmsnorm(h, self.norm, self.eps, self.threads)


def kv_arrays(
    layers: int, slots: int, G: int, max_seq_len: int, hd: int
) -> tuple[KVPages | None, np.ndarray, np.ndarray]:
    """The float32 KV cache k, v (L, slots, G, max_seq_len, hd): in shared pages
    (`models.kv_pages`: a prefix copy maps the source's blocks; views of the first max_seq_len
    of S >= max_seq_len positions, strided), else, where the OS gives none, plain zeroed arrays
    (copies take bytes; logged once). Pages appear as written."""
    try:
        pages = KVPages([G] * (2 * layers), slots, max_seq_len, hd * 4)
    except KVPagesUnavailable as e:
        warn_unavailable(str(e))
        shape = (layers, slots, G, max_seq_len, hd)
        return None, np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    k, v = (pages.array(first, layers, np.float32, hd) for first in (0, layers))
    return pages, k[..., :max_seq_len, :], v[..., :max_seq_len, :]


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data
