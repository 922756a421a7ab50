"""`make_model_dir`: a preset's random-weight model directory, deterministic for (preset, seed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from tandem.config import ModelConfig
from tandem.loaders.tokenizer_build import (
    SPECIAL_TOKENS,
    build_byte_bpe,
    tokenizer_config,
    word_token_ids,
)
from tandem.loaders.writer import write_model_dir
from tandem.models.presets import get_preset, hot_rows, random_weights


def make_model_dir(
    out: str | Path,
    preset: str,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    shard_bytes: int | None = None,
    config: ModelConfig | None = None,
) -> ModelConfig:
    """Writes the preset to `out` (weights stored in `dtype`, default the preset's; `config` in
    place of the preset's own shape) and returns its config."""
    p = get_preset(preset)
    dtype = dtype or p.dtype
    config = replace(config or p.config, torch_dtype=str(dtype).removeprefix("torch."))
    tok_json = tok_cfg = None
    hot = hot_rows(config, None)
    if p.tokenizer_vocab is not None:
        tok = build_byte_bpe(min(p.tokenizer_vocab, config.vocab_size))
        hot = hot_rows(config, word_token_ids(tok))
        tok_json, tok_cfg = tok.to_str(), tokenizer_config()
        ids = [tok.token_to_id(t) for t in (SPECIAL_TOKENS[0], SPECIAL_TOKENS[2])]
        config = replace(config, eos_token_ids=tuple(ids))
    tensors = random_weights(config, seed, dtype, hot)
    write_model_dir(
        out,
        config,
        tensors,
        tokenizer_json=tok_json,
        tokenizer_config=tok_cfg,
        shard_bytes=shard_bytes,
    )
    return config
