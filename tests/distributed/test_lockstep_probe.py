"""The lockstep probe runs real ranks joined by the TCP ring on loopback and reports its figures."""

import pytest

from tandem.config import ModelConfig
from tandem.models.presets import get_preset
from tandem.models.quant.blocks import BY_NAME
from tandem.plan.lockstep import POSITION, LockstepProbeError, measure_lockstep

TINY = ModelConfig.from_hf_dict({
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 128,
    "num_hidden_layers": 2, "tie_word_embeddings": True, "max_position_embeddings": 64,
})  # fmt: skip


def test_probe_times_k_ring_ranks_over_their_layer_shards_and_the_shard_alone():
    probe = measure_lockstep(TINY, ks=(2,), blocks=2, rounds=2, pool_mb=1, timeout_s=120)
    assert probe["position"] == POSITION and set(probe["by_k"]) == {"2"}
    f = probe["by_k"]["2"]
    assert f["alone_s"] > 0 and f["free_s"] > 0 and f["lockstep_s"] > 0
    assert len(f["rounds_lockstep_s"]) == 2 and f["lockstep_s"] == min(f["rounds_lockstep_s"])


def test_probe_runs_a_hybrids_deltanet_and_attention_shards():
    """A Qwen3.5 hybrid's probe shards keep its DeltaNet layers (their mixer in place of
    self_attn) and split their heads across the ring's ranks."""
    probe = measure_lockstep(
        get_preset("tiny-qwen35").config, ks=(2,), blocks=2, rounds=1, pool_mb=1, timeout_s=120
    )
    assert probe["by_k"]["2"]["lockstep_s"] > 0


def test_probe_ranks_multiply_the_block_types_they_are_given():
    """A GGUF file's block types (`weight_types`) travel to every probe rank, whose shards
    multiply them; the figures say which types they were."""
    types = {"self_attn.q_proj": BY_NAME["Q8_0"].type_id, "mlp.down_proj": BY_NAME["Q4_0"].type_id}
    probe = measure_lockstep(
        TINY, ks=(2,), blocks=2, rounds=1, pool_mb=1, timeout_s=120, types=types
    )
    assert probe["weight_types"] == {"self_attn.q_proj": "Q8_0", "mlp.down_proj": "Q4_0"}
    f = probe["by_k"]["2"]
    assert f["alone_s"] > 0 and f["lockstep_s"] > 0


def test_probe_refuses_degrees_below_two():
    with pytest.raises(LockstepProbeError):
        measure_lockstep(TINY, ks=(1,))
