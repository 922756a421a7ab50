"""A checkpoint's experts read as the reference model's stacked (E, out, in) tensors
(`loaders.expert_tensors`): per-expert tensors (what transformers writes), Mixtral's names and
transformers' fused in-memory form give the same values, any slice of one dimension reads only
that slice, and an incomplete set of experts is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.loaders.expert_tensors import ExpertLayoutError
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import ModelDir

GATE, UP, DOWN = (f"model.layers.0.mlp.experts.{p}_proj.weight" for p in ("gate", "up", "down"))


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe") / "per-expert"
    make_model_dir(d, "tiny-qwen3-moe")
    return d


def _fused_copy(src, out):
    """The same model with transformers' fused expert tensors (gate|up (E, 2I, D), down)."""
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    t = load_file(src / "model.safetensors")
    fused = {}
    for layer in (0, 2):  # the sparse layers
        p = f"model.layers.{layer}.mlp.experts."
        n = 8
        gate = torch.stack([t.pop(f"{p}{e}.gate_proj.weight") for e in range(n)])
        up = torch.stack([t.pop(f"{p}{e}.up_proj.weight") for e in range(n)])
        fused[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    save_file({**t, **fused}, out / "model.safetensors")
    return out


def test_per_expert_tensors_stack_into_the_models_experts(per_expert):
    md = ModelDir(per_expert)
    assert set(md.manifest) == set(md.config.checkpoint_names())
    raw = load_file(per_expert / "model.safetensors")
    gate = md.read(GATE)
    assert gate.shape == (8, 64, 64)
    assert torch.equal(gate[3], raw["model.layers.0.mlp.experts.3.gate_proj.weight"])
    assert md.info(GATE).shape == (8, 64, 64)


def test_the_fused_form_reads_the_same_values_and_slices(per_expert, tmp_path):
    a, b = ModelDir(per_expert), ModelDir(_fused_copy(per_expert, tmp_path / "fused"))
    for name in (GATE, UP, DOWN):
        assert torch.equal(a.read(name), b.read(name))
        for dim, lo, hi in ((0, 2, 5), (1, 16, 48), (2, 32, 64)):
            want = a.read(name).narrow(dim, lo, hi - lo)
            assert torch.equal(a.read(name, dim, lo, hi), want)
            assert torch.equal(b.read(name, dim, lo, hi), want)


def test_a_missing_expert_is_refused_by_name(per_expert, tmp_path):
    out = tmp_path / "holed"
    out.mkdir()
    cfg = json.loads((per_expert / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(per_expert / "model.safetensors")
    del t["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(t, out / "model.safetensors")
    with pytest.raises(ExpertLayoutError, match=r"layer 2 up_proj: expert\(s\) \[5\] missing"):
        ModelDir(out)


def test_gpt_oss_fused_transposed_interleaved_experts_read_as_the_stacked_ones(tmp_path):
    """gpt-oss's checkpoint form (gate_up_proj (E, D, 2I) with gate in the even columns,
    gate_up_proj_bias, down_proj (E, I, D), down_proj_bias, mlp.router) written from the
    reference tensors reads back as exactly those, whole and in slices of every dimension."""
    from dataclasses import replace

    from tandem.models.presets import get_preset, random_weights

    config = make_model_dir(tmp_path / "m", "tiny-gpt-oss")
    raw = load_file(tmp_path / "m" / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in raw and raw[
        "model.layers.0.mlp.experts.gate_up_proj"
    ].shape == (8, 64, 128)
    assert "model.layers.0.mlp.router.bias" in raw
    md = ModelDir(tmp_path / "m")
    assert set(md.manifest) == set(md.config.checkpoint_names())
    p = get_preset("tiny-gpt-oss")
    want = random_weights(replace(p.config, eos_token_ids=config.eos_token_ids), 0, torch.float32)
    hot = md.read("lm_head.weight")  # the hot rows depend on the tokenizer: compare the rest
    assert hot.shape == want["lm_head.weight"].shape
    for name in md.config.checkpoint_names():
        if "experts" not in name and "mlp.gate" not in name:
            continue
        assert torch.equal(md.read(name), want[name]), name
        t = want[name]
        for dim in range(t.dim()):
            lo, hi = 1, t.shape[dim] - 1
            assert torch.equal(md.read(name, dim, lo, hi), t.narrow(dim, lo, hi - lo)), (name, dim)
