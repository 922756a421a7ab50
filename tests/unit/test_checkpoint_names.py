"""`checkpoint_names` (no torch) names exactly the checkpoint tensors the reference model loads."""

from dataclasses import replace

import pytest

from tandem.models.checkpoint_names import checkpoint_names
from tandem.models.llama import Transformer
from tandem.models.presets import PRESETS
from tandem.models.skeleton import skeleton


def _model_names(config) -> set[str]:
    with skeleton():
        full = Transformer(config)
    return {full.checkpoint_name(n) for n, _ in full.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("preset", [p for p in PRESETS if p.startswith("tiny")])
def test_checkpoint_names_match_the_reference_model(preset: str) -> None:
    config = PRESETS[preset].config
    assert checkpoint_names(config) == _model_names(config)


def test_checkpoint_names_follow_every_bias_flag() -> None:
    config = replace(PRESETS["tiny-llama"].config, o_bias=True, mlp_bias=True, qkv_bias=True)
    names = checkpoint_names(config)
    assert names == _model_names(config)
    assert "model.layers.0.mlp.down_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" in names
