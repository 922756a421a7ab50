"""Does a TP plan fit each rank's memory? Pure arithmetic over the plan, checked before any shard
is loaded, so a plan that does not fit is refused by name instead of dying in the OOM killer.

Rank r of a TP plan over a model of L layers, hidden size D, head dim hd holds, in elements:

    weights_r = L D hd (2 q_r + 2 kv_r) + F_r + t D v_r
    kv_r      = 2 L B S kv_r hd                     (its K and V cache at the configured slots)

with q_r, kv_r its query and kv heads, v_r its vocabulary rows (t = 1 for a tied embedding, 2 when
the embedding and the LM head are separate matrices), B the batch slots and S the maximum sequence
length. F_r is the feed-forward it holds (`ffn_elements`), summed over the layers:

    dense layer        3 D m_r                      (m_r its MLP rows)
    sparse layer       E D + 3 D h_r + 3 D s_r + [s > 0] D              (`moe_ffn_elements`)

A sparse (mixture-of-experts) layer holds the router (E x D, on every rank: each routes the full
token), h_r expert rows (`plan.held_expert_rows(r)`, over its groups of experts: under `--moe tp`
its rows of every expert, about E w / N by weight; under `--moe experts` its n_r whole experts,
n_r w) and its rows s_r of the shared expert (width s) with the
shared expert's gate (D) where the family has one. Qwen3-MoE's dense layers among sparse ones
(`mlp_only_layers`, `decoder_sparse_step`) are dense layers of `intermediate_size`. A pipeline
stage holds whole layers, dense or sparse, weighed by `partition.layer_held_params`.

Bytes are weights_r * w + kv_r * e, with e the rank's compute-dtype element size and w the
weights' stored bytes per element (e for a dense checkpoint; for a quantized file its matrices'
average block bytes per element, blocks staying quantized). Norms and
biases (a few D per layer) are left out; `HEADROOM_BYTES` covers them and the runtime's own
buffers. A rank needs  weights + kv + HEADROOM_BYTES <= free  (its probe's free memory).

One node alone (`check_node`) is held to the same rule before its KV cache is allocated: the
whole model's weights (0 where they stay mapped from the file) and its cache at B slots of S
positions against the node's free memory, so `--max-seq-len 16777216` is refused naming the bytes
instead of ending in an allocator's traceback.

Ranks on one host that hold their shards in its RAM each measured the same free memory: k of them
share it, so each is held to  min(its own free, host free / k)  (`share_host_memory`; the host's
free is the largest of their figures, a rank's own may be lower under a memory limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HEADROOM_BYTES = 64 << 20


class PlanDoesNotFitError(ValueError):
    """A rank's share of the weights and its KV cache exceed the memory it has free."""


@dataclass(frozen=True)
class RankNeed:
    rank: int
    weight_bytes: int
    kv_bytes: int
    free_bytes: int

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + HEADROOM_BYTES

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.free_bytes


def moe_ffn_elements(config: Any, plan: Any, rank: int) -> int:
    """Elements of one sparse layer's feed-forward that `rank` holds under `plan` (module
    docstring: router, its experts' gate/up/down at its rows, its shared-expert rows and gate)."""
    spec, D = config.moe, config.hidden_size
    held = spec.num_experts * D  # the router, replicated
    held += 3 * D * plan.held_expert_rows(rank)
    if spec.shared_intermediate_size:
        held += 3 * D * plan.shared_rows[rank].size + D
    return held


def ffn_elements(config: Any, plan: Any, rank: int, layers: range) -> int:
    """`F_r`: the feed-forward elements `rank` holds over `layers` (module docstring)."""
    dense = 3 * config.hidden_size * plan.intermediate[rank].size
    sparse = moe_ffn_elements(config, plan, rank) if getattr(config, "moe", None) else 0
    return sum(sparse if _is_sparse(config, i) else dense for i in layers)


def _is_sparse(config: Any, layer: int) -> bool:
    moe = getattr(config, "moe", None)
    return moe is not None and moe.is_sparse(layer)


def rank_needs(
    config: Any,
    plan: Any,
    *,
    elem_bytes: list[int],
    weight_bytes_per_elem: list[float],
    free_bytes: list[int],
    max_batch: int,
    max_seq_len: int,
) -> list[RankNeed]:
    """Each rank's weight and KV-cache bytes under `plan` (module docstring), against its free."""
    D, hd, L = config.hidden_size, config.head_dim, config.num_hidden_layers
    tied = 1 if getattr(config, "tie_word_embeddings", False) else 2
    out = []
    for r in range(plan.world_size):
        q, kv, v = plan.q_heads(r).size, plan.kv_heads[r].size, plan.vocab[r].size
        ffn = ffn_elements(config, plan, r, range(L))
        weights = L * D * hd * (2 * q + 2 * kv) + ffn + tied * D * v
        cache = 2 * L * max_batch * max_seq_len * kv * hd
        out.append(
            RankNeed(
                r,
                int(weights * weight_bytes_per_elem[r]),
                cache * elem_bytes[r],
                int(free_bytes[r]),
            )
        )
    return out


def share_host_memory(free_bytes: list[int], hosts: list[str | None]) -> list[int]:
    """Each rank's free bytes with a host's RAM divided among the ranks that hold their shards in
    it (module docstring). `hosts[r]`: rank r's host, or None where its memory is its own (a GPU)."""
    count: dict[str, int] = {}
    host_free: dict[str, int] = {}
    for f, h in zip(free_bytes, hosts, strict=True):
        if h is not None:
            count[h] = count.get(h, 0) + 1
            host_free[h] = max(host_free.get(h, 0), f)
    return [
        f if h is None else min(f, host_free[h] // count[h])
        for f, h in zip(free_bytes, hosts, strict=True)
    ]


PLAN_ADVICE = (
    "Give that rank a smaller --tp-weights share, lower --max-seq-len or --max-batch, or add a rank"
)
NODE_ADVICE = "Lower --max-seq-len or --max-batch, or spread the model over ranks (--tp / --pp)"


def kv_cache_bytes(config: Any, max_batch: int, max_seq_len: int, elem_bytes: int) -> int:
    """K and V of every attention layer, and every recurrent layer's state, for `max_batch`
    sequences of `max_seq_len` positions, all heads (`sequence_cache_bytes`)."""
    return max_batch * sum(sequence_cache_bytes(config, max_seq_len, elem_bytes).values())


def sequence_cache_bytes(
    config: Any,
    max_seq_len: int,
    elem_bytes: int,
    layers: tuple[int, int] | None = None,
    plan: Any = None,
    rank: int = 0,
) -> dict[str, int]:
    """What one sequence's cache slot holds in layers `[start, end)` (all by default) on TP rank
    `rank` of `plan` (None: all heads), as `models.kv_cache.KVCache` allocates it:
    `kv`: 2 max_seq_len kv_heads head_dim elements per attention layer, in the compute dtype;
    `state`: per Gated DeltaNet layer (no keys or values), its conv window (conv channels x
    (K - 1), compute dtype) and one dk x dv matrix per v head (float32), whatever the length."""
    start, end = layers or (0, config.num_hidden_layers)
    kv_heads = config.num_key_value_heads if plan is None else plan.kv_heads[rank].size
    spec = getattr(config, "deltanet", None)
    kv = state = 0
    for i in range(start, end):
        if spec is None or i not in spec.linear_layers:
            kv += 2 * max_seq_len * kv_heads * config.head_dim * elem_bytes
            continue
        hk, hv = spec.num_key_heads, spec.num_value_heads
        if plan is not None:
            hk, hv = plan.linear_k_heads[rank].size, plan.linear_v_heads(rank).size
        channels = 2 * hk * spec.key_head_dim + hv * spec.value_head_dim
        state += channels * (spec.conv_kernel - 1) * elem_bytes
        state += hv * spec.key_head_dim * spec.value_head_dim * 4
    return {"kv": kv, "state": state}


def check_node(
    config: Any,
    *,
    kv_elem_bytes: int,
    weight_bytes: int,
    free_bytes: int | None,
    max_batch: int,
    max_seq_len: int,
) -> None:
    """One node's whole model and KV cache against its free memory (module docstring); nothing
    checked where the free memory is unknown (None)."""
    if free_bytes is None:
        return
    kv = kv_cache_bytes(config, max_batch, max_seq_len, kv_elem_bytes)
    need = RankNeed(0, int(weight_bytes), kv, int(free_bytes))
    if not need.fits:
        raise PlanDoesNotFitError(
            f"the model does not fit this node: it needs {need.need_bytes / 1e9:.3f} GB "
            f"({weight_bytes / 1e9:.3f} GB of weights + {kv / 1e9:.3f} GB ({kv} bytes) of KV "
            f"cache for {max_batch} sequences of {max_seq_len} positions + "
            f"{HEADROOM_BYTES / 1e9:.3f} GB headroom) but has {free_bytes / 1e9:.3f} GB free. "
            + NODE_ADVICE
        )


def check_fit(needs: list[RankNeed]) -> None:
    """Raises `PlanDoesNotFitError` naming every rank that does not fit and its bytes."""
    bad = [n for n in needs if not n.fits]
    if not bad:
        return
    parts = [
        f"rank {n.rank} needs {n.need_bytes / 1e9:.3f} GB ({n.weight_bytes / 1e9:.3f} GB of "
        f"weights + {n.kv_bytes / 1e9:.3f} GB of KV cache + {HEADROOM_BYTES / 1e9:.3f} GB "
        f"headroom) but has {n.free_bytes / 1e9:.3f} GB free"
        for n in bad
    ]
    raise PlanDoesNotFitError("the plan does not fit: " + "; ".join(parts) + ". " + PLAN_ADVICE)
