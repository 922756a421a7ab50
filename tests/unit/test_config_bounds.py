"""Every ModelConfig field is bounded and validated before anything is built: a config.json with
a billion layers, a zero rope_theta or a NaN epsilon is one typed error naming the field, the
value and the allowed range, not an OOM kill or silently empty output."""

from __future__ import annotations

import dataclasses
import json
import math

import psutil
import pytest

from tandem.config import ConfigError, ConfigFieldError, ModelConfig
from tandem.loaders.make import make_model_dir
from tandem.models.presets import PRESETS


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("m")
    make_model_dir(d / "m", "tiny-llama", seed=0)
    return json.loads((d / "m" / "config.json").read_text())


def _from(tmp_path, cfg: dict, raw: str | None = None) -> ModelConfig:
    (tmp_path / "config.json").write_text(raw if raw is not None else json.dumps(cfg))
    return ModelConfig.from_dir(tmp_path)


HOSTILE = [
    ("num_hidden_layers", 1_000_000_000, "num_hidden_layers = 1000000000.*\\[1, 1024\\]"),
    ("vocab_size", 0, "vocab_size = 0.*\\[1, "),
    ("hidden_size", 1 << 30, "hidden_size = 1073741824"),
    ("intermediate_size", -5, "intermediate_size = -5"),
    ("max_position_embeddings", 1 << 40, "max_position_embeddings"),
    ("rope_theta", 0, "rope_theta = 0.0.*\\[1, 1e\\+12\\]"),
    ("rope_theta", 10**400, "rope_theta.*finite"),
    ("rms_norm_eps", 0.0, "rms_norm_eps = 0.0.*\\[1e-12, 1\\]"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps = -1e-06"),
    ("head_dim", 3, "head_dim = 3.*even"),
    ("head_dim", 4096, "head_dim = 4096.*\\[2, 1024\\]"),
    ("num_key_value_heads", 3, "num_key_value_heads = 3.*divisor of num_attention_heads"),
    ("eos_token_id", ["2"], "eos_token_id = '2'"),
    ("eos_token_id", list(range(100)), "eos_token_id.*at most 64"),
    ("bos_token_id", -1, "bos_token_id = -1.*\\[0, 2147483647\\]"),
]


@pytest.mark.parametrize("field,value,pattern", HOSTILE)
def test_a_field_out_of_range_is_a_typed_error_naming_field_value_and_range(
    tmp_path, good, field, value, pattern
) -> None:
    with pytest.raises(ConfigFieldError, match=f"config.json: {pattern}") as e:
        _from(tmp_path, {**good, field: value})
    assert e.value.name == field


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_nan_or_infinite_epsilon_or_theta_is_refused(tmp_path, good, literal) -> None:
    for field in ("rms_norm_eps", "rope_theta"):
        raw = json.dumps({**good, field: 0.5}).replace(": 0.5", f": {literal}")
        with pytest.raises(ConfigFieldError, match=f"{field} = (nan|inf|-inf)"):
            _from(tmp_path, {}, raw)


def test_llama3_rope_scaling_factors_are_bounded_and_ordered(tmp_path, good) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert _from(tmp_path, {**good, "rope_scaling": scaling}).rope_scaling.factor == 8.0
    for change, pattern in [
        ({"factor": 0.0}, "rope_scaling.factor = 0.0"),
        ({"high_freq_factor": 1.0}, "rope_scaling.high_freq_factor = 1.0.*low_freq_factor"),
        ({"original_max_position_embeddings": 0}, "original_max_position_embeddings = 0"),
    ]:
        with pytest.raises(ConfigFieldError, match=pattern):
            _from(tmp_path, {**good, "rope_scaling": {**scaling, **change}})


def test_a_billion_layers_is_refused_before_anything_grows(tmp_path, good) -> None:
    me = psutil.Process()
    rss0 = me.memory_info().rss
    with pytest.raises(ConfigError):
        _from(tmp_path, {**good, "num_hidden_layers": 1_000_000_000})
    assert me.memory_info().rss - rss0 < 10 << 20


def test_direct_construction_is_validated_too_and_every_preset_passes() -> None:
    for preset in PRESETS.values():
        preset.config.validate()
    base = next(iter(PRESETS.values())).config
    with pytest.raises(ConfigFieldError, match="model config: rms_norm_eps = nan"):
        dataclasses.replace(base, rms_norm_eps=math.nan)
