"""Phi-3 / Phi-4-mini config.json parsing (`models.families.phi3`): partial rotary, longrope with
transformers' attention factor, the sliding window, no biases; what tandem does not run is refused
naming it; and the head's longrope rewind (`engine.rope_rewind`)."""

import math

import pytest

from tandem.config import ConfigError, ConfigFieldError, ModelConfig
from tandem.engine.executor import Step, StepSequence
from tandem.engine.rope_rewind import LongRopeRewind

PHI4_MINI = {  # microsoft/Phi-4-mini-instruct's switches at a tiny size
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "vocab_size": 200,
    "hidden_size": 96,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + i / 10 for i in range(9)],
        "long_factor": [2.0 + i for i in range(9)],
    },
    "sliding_window": 262144,
    "tie_word_embeddings": True,
}


def test_phi4_mini_config_reads_partial_rotary_longrope_and_its_attention_factor():
    c = ModelConfig.from_hf_dict(PHI4_MINI)
    assert c.head_dim == 24 and c.rotary_dim == 18
    s = c.rope_scaling
    assert s.rope_type == "longrope" and s.original_max_position_embeddings == 4096
    assert s.short_factor[1] == 1.1 and s.long_factor[-1] == 10.0
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert c.sliding_window == 262144 and c.window(1) == 262144
    assert not (c.qkv_bias or c.o_bias or c.mlp_bias)
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_phi3_mini_4k_config_keeps_its_sliding_window_and_plain_rope():
    d = {**PHI4_MINI, "sliding_window": 2047, "partial_rotary_factor": 1.0, "rope_scaling": None}
    c = ModelConfig.from_hf_dict(d)
    assert c.sliding_window == 2047 and c.rope_scaling is None and c.rotary_dim == c.head_dim


def test_a_stated_attention_factor_and_the_legacy_su_type_are_read():
    rope = {**PHI4_MINI["rope_scaling"], "type": "su", "attention_factor": 1.5}
    c = ModelConfig.from_hf_dict({**PHI4_MINI, "rope_scaling": rope})
    assert c.rope_scaling.rope_type == "longrope" and c.rope_scaling.attention_factor == 1.5


def test_a_rope_type_phi3_does_not_run_is_refused_by_name():
    rope = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(ConfigError, match="Phi-3 rope_type 'dynamic' is not supported"):
        ModelConfig.from_hf_dict({**PHI4_MINI, "rope_scaling": rope})


def test_longrope_factor_lists_of_the_wrong_length_or_value_are_refused():
    rope = {**PHI4_MINI["rope_scaling"], "short_factor": [1.0] * 12}
    with pytest.raises(ConfigFieldError, match="short_factor"):
        ModelConfig.from_hf_dict({**PHI4_MINI, "rope_scaling": rope})
    rope = {**PHI4_MINI["rope_scaling"], "long_factor": [0.0] * 9}
    with pytest.raises(ConfigFieldError, match="long_factor"):
        ModelConfig.from_hf_dict({**PHI4_MINI, "rope_scaling": rope})
    with pytest.raises(ConfigFieldError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict({**PHI4_MINI, "partial_rotary_factor": 1.5})


def _rows(step):
    return [(s.seq_id, s.token_ids, s.start_pos) for s in step.sequences]


def test_the_rewind_recomputes_a_sequence_that_crosses_the_switch_either_way():
    r = LongRopeRewind(4)
    step = Step((StepSequence(0, (1, 2, 3), 0), StepSequence(1, (7,), 0)))
    assert r.expand(step) is step  # nothing held yet: untouched
    crossing = Step((StepSequence(0, (4, 5), 3), StepSequence(1, (8,), 1)))
    assert _rows(r.expand(crossing)) == [(0, (1, 2, 3, 4, 5), 0), (1, (8,), 1)]
    assert _rows(r.expand(Step((StepSequence(0, (6,), 5),)))) == [(0, (6,), 5)]  # stays long
    back = Step((StepSequence(0, (9,), 2),))  # a rewind to 3 tokens: short again, recomputed
    assert _rows(r.expand(back)) == [(0, (1, 2, 9), 0)]
    r.release([0])
    assert _rows(r.expand(Step((StepSequence(0, (1,), 0),)))) == [(0, (1,), 0)]
    assert LongRopeRewind(None).expand(crossing) is crossing
