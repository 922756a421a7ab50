"""The tensor-parallel transform: the reference `Transformer`, rebuilt for one rank of a TP group.

Built on the meta device (no memory), then each projection is swapped for its parallel twin and
only this rank's shard is allocated, on this rank's device, in this rank's compute dtype:

    attention  q_proj, k_proj, v_proj -> ColumnParallelLinear over the rank's kv-head group
               o_proj                 -> RowParallelLinear (all-reduce)
               n_heads, n_kv_heads    -> the local counts; q_norm/k_norm (per head) are replicated;
               sinks (gpt-oss)        -> the rank's query heads'
    MLP        gate_proj, up_proj     -> ColumnParallelLinear over intermediate rows
               down_proj              -> RowParallelLinear (all-reduce)
               on a rank without attention (`plan.attn_ranks`): AbsentAttention (adds zeros
               to o_proj's all-reduce; no weights, no KV cache)
    MoE        a sparse layer's mlp   -> ParallelMoE: its experts' rows or whole experts, the
                                      router replicated (`parallel.moe`, `TPPlan.moe`)
    embedding  embed_tokens           -> VocabParallelEmbedding (all-reduce)
    LM head    lm_head                -> VocabParallelLMHead (logits to rank 0 only; tied -> shared)
    norms                             -> replicated
    DeltaNet   in_proj_qkv/z/b/a      -> ColumnParallelLinear over the rank's q/k heads and their
               (Qwen3.5's linear         v heads (q, k, v rows: three ranges), conv channels and
               layers)                   A_log / dt_bias to match; out_proj -> RowParallelLinear
                                         (all-reduce); the recurrent state stays local; quantized
                                         projections over their blocks as the others
    gated attn q_proj                 -> 2 hd rows per query head (query and gate)

A quantized source passes `qtypes` (checkpoint name -> GGUF block type of each quantized tensor):
those layers are built over their blocks (`tensor` module docstring) and `shard_load` fills them.
With the plan's `o_split == "gather"`, o_proj contracts `plan.o_columns(r)` of the gathered
attention output instead of the rank's own heads.

A pipeline stage passes its `layer_range` and whether it holds the embedding and the head; the
layers keep their global indices.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tandem.comm.base import Communicator
from tandem.config import ModelConfig
from tandem.models.llama import Transformer
from tandem.models.rope import RotaryEmbedding
from tandem.models.skeleton import skeleton
from tandem.parallel.absent import AbsentAttention
from tandem.parallel.moe import parallel_moe
from tandem.parallel.plan import TPPlan
from tandem.parallel.tensor import (
    ColumnParallelLinear,
    GatheredInput,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)

MAX_EXACT_VOCAB = 2**24  # token ids travel as float32 in VocabParallelLMHead.argmax


class TransformError(ValueError):
    """The plan and the communicator (or the model) disagree."""


def shard_transformer(
    config: ModelConfig,
    plan: TPPlan,
    comm: Communicator,
    *,
    layer_range: tuple[int, int] | None = None,
    with_embed: bool = True,
    with_head: bool = True,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    qtypes: Mapping[str, int] | None = None,
) -> Transformer:
    """This rank's (`comm.rank`) shard of the model, parameters allocated but not loaded."""
    qt = dict(qtypes or {})
    if plan.world_size != comm.world_size:
        raise TransformError(f"plan for {plan.world_size} ranks, communicator of {comm.world_size}")
    if with_head and comm.world_size > 1 and config.vocab_size > MAX_EXACT_VOCAB:
        raise TransformError(
            f"vocab_size {config.vocab_size} exceeds 2^24: the vocab-parallel argmax sends token "
            f"ids as float32 wire values, exact only up to 2^24"
        )
    r = comm.rank
    D = config.hidden_size
    meta = torch.device("meta")
    with skeleton():  # the meta device, initializers skipped
        model = Transformer(config, layer_range, with_embed, with_head)
    model.rope = RotaryEmbedding(config)  # built under meta above; its tables live on the host
    q, kv, inter, vocab = plan.q_rows(r), plan.kv_rows(r), plan.intermediate[r], plan.vocab[r]
    oc = plan.o_columns(r)
    gather = None
    if plan.o_split == "gather":
        gather = GatheredInput(q.start, q.end, plan.n_heads * plan.head_dim, oc.start, oc.end)
    if not plan.holds_attention(r) and config.o_bias:
        raise TransformError(
            "attention on fewer ranks than the MLP needs a model without o_proj bias"
        )
    for i, layer in model.model.layers.items():
        p = f"model.layers.{i}."

        def col(name: str, out: int, bias: bool, p: str = p) -> ColumnParallelLinear:
            qtype = qt.get(p + name + ".weight")
            return ColumnParallelLinear(D, out, bias, qtype=qtype, device=meta)

        if config.is_linear(int(i)):
            _shard_deltanet(layer.linear_attn, plan, comm, r, D, qt, p)
        elif plan.holds_attention(r):
            attn = layer.self_attn
            attn.q_proj = col("self_attn.q_proj", plan.q_proj_rows(r).size, config.qkv_bias)
            attn.k_proj = col("self_attn.k_proj", kv.size, config.qkv_bias)
            attn.v_proj = col("self_attn.v_proj", kv.size, config.qkv_bias)
            attn.o_proj = RowParallelLinear(
                oc.size,
                D,
                config.o_bias,
                comm,
                qtype=qt.get(p + "self_attn.o_proj.weight"),
                gather=gather,
                device=meta,
            )
            attn.n_heads = plan.q_heads(r).size
            attn.n_kv_heads = plan.kv_heads[r].size
            if attn.sinks is not None:  # one per query head: the rank's heads'
                attn.sinks = nn.Parameter(torch.empty(attn.n_heads, device=meta))
        else:  # no heads here: meets o_proj's all-reduce with zeros
            layer.self_attn = AbsentAttention(comm, int(i), plan.head_dim)
        if config.is_sparse(int(i)):
            with skeleton():
                layer.mlp = parallel_moe(D, config.moe, plan, comm, p, qt)
            continue
        mlp = layer.mlp
        mlp.gate_proj = col("mlp.gate_proj", inter.size, config.mlp_bias)
        mlp.up_proj = col("mlp.up_proj", inter.size, config.mlp_bias)
        mlp.down_proj = RowParallelLinear(
            inter.size,
            D,
            config.mlp_bias,
            comm,
            qtype=qt.get(p + "mlp.down_proj.weight"),
            device=meta,
        )
    if with_embed:
        model.model.embed_tokens = VocabParallelEmbedding(
            vocab.start,
            vocab.end,
            D,
            comm,
            qtype=qt.get("model.embed_tokens.weight"),
            device=meta,
            dtype=dtype,
        )
    if with_head:
        head_qtype = qt.get(model.checkpoint_name("lm_head.weight"))
        model.lm_head = VocabParallelLMHead(
            vocab.start, vocab.end, D, comm, qtype=head_qtype, device=meta
        )
    _materialize(model, torch.device(device), dtype)
    tied = with_head and with_embed and config.tie_word_embeddings
    if tied and model.lm_head.quant is None:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _shard_deltanet(net, plan: TPPlan, comm: Communicator, r: int, D: int, qt, p: str) -> None:
    """A Gated DeltaNet layer's rank-`r` shard (`plan` module docstring): its q/k heads and the
    v heads they serve, in_proj_* column-parallel, out_proj row-parallel (one all-reduce); a
    projection stored block-quantized is built over its blocks (its rows; out_proj's columns on
    block edges, `TPPlan.linear_align`). The conv, A, dt and the norm are float tensors: stored
    quantized, they are refused (TransformError)."""
    a = p + "linear_attn."
    odd = sorted(
        k for k in qt if k.startswith(a) and ".in_proj_" not in k and ".out_proj." not in k
    )
    if odd:
        raise TransformError(
            f"{odd[0]} is block-quantized: a DeltaNet conv/A/dt/norm is sharded as floats"
        )
    meta = torch.device("meta")
    k, v = plan.linear_k_heads[r], plan.linear_v_heads(r)
    net.n_k_heads, net.n_v_heads = k.size, v.size
    channels = net.conv_channels

    def col(name: str, out: int) -> ColumnParallelLinear:
        return ColumnParallelLinear(D, out, False, qtype=qt.get(f"{a}{name}.weight"), device=meta)

    net.in_proj_qkv = col("in_proj_qkv", channels)
    net.in_proj_z = col("in_proj_z", v.size * net.dv)
    net.in_proj_b = col("in_proj_b", v.size)
    net.in_proj_a = col("in_proj_a", v.size)
    with skeleton():
        net.conv1d = nn.Conv1d(channels, channels, net.kernel, groups=channels, bias=False)
    net.dt_bias = nn.Parameter(torch.empty(v.size, device=meta))
    net.A_log = nn.Parameter(torch.empty(v.size, device=meta))
    net.out_proj = RowParallelLinear(
        v.size * net.dv, D, False, comm, qtype=qt.get(a + "out_proj.weight"), device=meta
    )


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replaces every meta parameter with an uninitialised one of the same shape, allocated once
    directly in `dtype` on `device` (no float32 detour that would double a 16-bit rank's peak).
    A parameter held by two modules (a column-parallel layer's bias and its `quant` module's)
    stays one parameter."""
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta) -> (meta kept alive, new)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    t = torch.empty(p.shape, dtype=dtype, device=device)
                    made[id(p)] = (p, nn.Parameter(t, requires_grad=False))
                module._parameters[name] = made[id(p)][1]
