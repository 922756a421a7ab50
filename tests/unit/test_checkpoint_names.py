"""`ModelConfig.checkpoint_names` (torch-free: the GGUF loader checks a file's tensors against it)
names exactly the checkpoint tensors the reference model's parameters read, for every preset and
every optional part (biases, q/k norms, tied or untied head)."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.models.llama import Transformer
from tandem.models.presets import PRESETS
from tandem.models.skeleton import skeleton


def _variants():
    for name, preset in PRESETS.items():
        yield name, preset.config
    c = PRESETS["tiny-llama"].config
    yield "all-biases", dataclasses.replace(c, qkv_bias=True, o_bias=True, mlp_bias=True)
    yield "qk-norm-tied", dataclasses.replace(c, qk_norm=True, tie_word_embeddings=True)


@pytest.mark.parametrize(("name", "config"), list(_variants()), ids=lambda v: str(v)[:20])
def test_checkpoint_names_are_the_reference_models_parameters(name, config) -> None:
    with skeleton():
        model = Transformer(config)
    used = {model.checkpoint_name(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    assert config.checkpoint_names() == used
