"""Writes a model directory in the exact Hugging Face layout: config.json, model.safetensors (or
shards + model.safetensors.index.json), and optionally tokenizer.json + tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.config import ModelConfig
from tandem.loaders.expert_tensors import checkpoint_tensors
from tandem.loaders.fused_rows import fuse, rules_for
from tandem.loaders.mxfp4_dir import mxfp4_checkpoint
from tandem.loaders.safetensors_dir import INDEX_FILE, SINGLE_FILE
from tandem.loaders.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE


def write_model_dir(
    out: str | Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    *,
    tokenizer_json: str | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    shard_bytes: int | None = None,
) -> Path:
    """Writes `out`; with `shard_bytes`, tensors go into shards of about that size plus an index.
    `tensors` are the reference model's; experts are written as the family's checkpoints hold
    them (`expert_tensors.checkpoint_tensors`), fused projections fused (`fused_rows.fuse`); with
    `config.quant_method` "mxfp4" the experts' weights in MXFP4 blocks as OpenAI's checkpoints
    store them (`mxfp4_dir.mxfp4_checkpoint`)."""
    if config.quant_method == "mxfp4":
        tensors = mxfp4_checkpoint(tensors)
    tensors = fuse(checkpoint_tensors(config.architecture, tensors), rules_for(config))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    meta = {"format": "pt"}
    if shard_bytes is None:
        save_file(tensors, str(out / SINGLE_FILE), metadata=meta)
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer_json is not None:
        (out / TOKENIZER_FILE).write_text(tokenizer_json)
        (out / TOKENIZER_CONFIG_FILE).write_text(
            json.dumps(tokenizer_config or {}, indent=2) + "\n"
        )
    return out
