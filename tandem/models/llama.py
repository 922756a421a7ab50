"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and the mixture-of-experts Qwen3-MoE and
Mixtral, whose sparse layers hold `models.moe.MoE` as their `mlp`) in plain PyTorch: the
single-device reference every parallel path is proven against. A config with sandwich norms
(Gemma 3) gets `models.gemma.SandwichDecoderLayer`s, its final norm `make_norm`'s kind, and its
embeddings times `embed_scale`. A hybrid config (Qwen3.5: `deltanet`) gets
`models.qwen35.HybridDecoderLayer`s, Gated DeltaNet or gated attention by layer.

Module names equal Hugging Face state-dict keys (`model.embed_tokens`, `model.layers.<i>.self_attn.
q_proj`, ..., `model.norm`, `lm_head`), so checkpoints load by name. `model.layers` is keyed by the
*global* layer index: a pipeline stage built with `layer_range=(a, b)` holds layers a..b-1 only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.models.attention import Attention
from tandem.models.context import ForwardContext, build_context
from tandem.models.gemma import SandwichDecoderLayer
from tandem.models.kv_cache import KVCache
from tandem.models.layers import MLP, RMSNorm, make_norm
from tandem.models.moe import MoE
from tandem.models.qwen35 import HybridDecoderLayer
from tandem.models.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        if config.is_sparse(layer_idx):
            self.mlp: nn.Module = MoE(config.hidden_size, config.moe)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """Holds layers `layer_range = [start, end)` (all by default), the embedding when `with_embed`,
    and the final norm + lm_head when `with_head`.

    With tied embeddings and both ends present, `lm_head.weight` is `model.embed_tokens.weight`;
    a head-only stage keeps its own lm_head, loaded from `model.embed_tokens.weight`
    (`checkpoint_name` says which tensor feeds each parameter).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_range: tuple[int, int] | None = None,
        with_embed: bool = True,
        with_head: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        start, end = layer_range or (0, config.num_hidden_layers)
        if not 0 <= start <= end <= config.num_hidden_layers:
            raise ValueError(f"layer_range {layer_range} outside [0, {config.num_hidden_layers})")
        self.layer_range = (start, end)
        self.with_embed, self.with_head = with_embed, with_head
        self.rope = RotaryEmbedding(config)
        self.model = nn.Module()
        if with_embed:
            self.model.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        layer: type[nn.Module] = DecoderLayer
        if config.norm_placement == "sandwich":
            layer = SandwichDecoderLayer
        elif config.deltanet is not None:
            layer = HybridDecoderLayer
        self.model.layers = nn.ModuleDict({str(i): layer(config, i) for i in range(start, end)})
        if with_head:
            self.model.norm = make_norm(config, config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.tie_word_embeddings and with_embed:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def checkpoint_name(self, param_name: str) -> str:
        """The checkpoint tensor that holds `param_name` (differs only for a tied lm_head)."""
        if param_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return param_name

    def context(
        self,
        start_pos: Sequence[int],
        lengths: Sequence[int],
        cache: KVCache | None = None,
        slots: Sequence[int] | None = None,
    ) -> ForwardContext:
        """The per-step context (see `tandem.models.context`) in this model's dtype and device."""
        return build_context(
            self.rope,
            start_pos,
            lengths,
            dtype=self.dtype,
            device=self.device,
            cache=cache,
            slots=slots,
            sliding_window=self.config.sliding_window,
            window_everywhere=self.config.window_layers is None,
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> h (B, T, hidden_size), times `embed_scale` where the config
        sets one (rounded to float32, then to h's dtype, as transformers rounds Gemma's)."""
        h = self.model.embed_tokens(tokens)
        if self.config.embed_scale is None:
            return h
        return h * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(h.dtype)

    def forward_layers(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Runs the held layers in ascending global index; h (B, T, D) -> (B, T, D)."""
        shape = h.shape
        x = h.reshape(-1, shape[-1])  # (B*T, D): 2-D inputs take the shortest path through linear
        for layer in self.model.layers.values():
            x = layer(x, ctx)
        return x.view(shape)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) -> logits (B, T, vocab_size), in the compute dtype."""
        return self.lm_head(self.model.norm(h))

    def head_argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """h (B, T, D) -> argmax token ids (B, T) int64 of `head(h)`, ties to the lowest id. A head
        with its own `argmax` (the vocab-parallel head) answers without gathering the logits and
        may return None (off the rank that samples)."""
        x = self.model.norm(h)
        pick = getattr(self.lm_head, "argmax", None)
        if pick is not None:
            return pick(x)
        return self.lm_head(x).argmax(-1)  # (B, T, vocab) -> (B, T)

    def last_hidden(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """h (B, T, D) -> (B, 1, D) at each row's last real token."""
        if ctx.lengths and all(n == h.shape[1] for n in ctx.lengths):
            return h[:, -1:]
        return h[torch.arange(h.shape[0], device=h.device), ctx.last_index][:, None]

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab_size). Without ctx: a full causal pass from
        position 0 with no cache (training, scoring)."""
        if ctx is None:
            B, T = tokens.shape
            ctx = self.context([0] * B, [T] * B)
        return self.head(self.forward_layers(self.embed(tokens), ctx))


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding, whose init (`normal_`) is skipped on the meta device: there, normal_ goes
    through torch's Python reference ops, whose first use imports torch._dynamo (seconds of every
    process's load, for values a loader overwrites anyway)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)
