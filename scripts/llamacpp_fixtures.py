"""Writes the GGUF test fixtures that llama.cpp itself makes: random-weight models of tandem's
presets saved as Hugging Face directories, converted by llama.cpp's `convert_hf_to_gguf.py` and
quantized by its `llama-quantize`, into tests/fixtures/gguf/. The tests read them with tandem and
compare with transformers; they never run llama.cpp (CI has no build of it).

    python scripts/llamacpp_fixtures.py [NAME ...]   # all, or these; needs ../shared/tools/llamacpp.sh

The converter recognizes a tokenizer's pre-tokenizer by hashing its output on a test text; the
presets' small byte-level BPE is in no list of known ones, so it is labelled `gpt-4o` (the regex
split tandem's GGUF tokenizer then applies; the ids in these tests are given, not tokenized).
Its Phi-3 vocabulary reader wants a SentencePiece `tokenizer.model` unless the tokenizer class is
GPT2Tokenizer (Phi-4's): the presets' BPE is read as that one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "gguf"


def llamacpp() -> Path:
    tool = ROOT.parent / "shared" / "tools" / "llamacpp.sh"
    return Path(
        subprocess.run([str(tool)], check=True, capture_output=True, text=True).stdout.strip()
    )


def gpt_oss_config():
    """tiny-gpt-oss as llama.cpp runs gpt-oss: the clamped SwiGLU's limit 7 (a constant there)
    and YaRN's truncated correction range (what it computes)."""
    from tandem.models.presets import get_preset

    c = get_preset("tiny-gpt-oss").config
    return replace(
        c, rope_scaling=replace(c.rope_scaling, truncate=True), moe=replace(c.moe, swiglu_limit=7.0)
    )


def phi3_config():
    """tiny-phi3 as Phi-3.5 / Phi-4-mini shape it: partial rotary (48 of 64 dims: the converter
    derives the width from hidden / heads), longrope switching past 32 tokens (24 factors a set),
    no window (the one-call decode)."""
    from tandem.models.presets import get_preset

    c = get_preset("tiny-phi3").config
    scaling = replace(
        c.rope_scaling,
        short_factor=tuple(1.0 + i / 20 for i in range(24)),
        long_factor=tuple(1.0 + i / 2 for i in range(24)),
    )
    return replace(
        c, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, rope_scaling=scaling, sliding_window=None,
    )  # fmt: skip


def qwen2_moe_config():
    """tiny-qwen2-moe sparse on every layer: llama.cpp's qwen2moe graph has no dense layers
    (nor does a GGUF file state `mlp_only_layers` for transformers to read)."""
    from tandem.models.presets import get_preset

    c = get_preset("tiny-qwen2-moe").config
    return replace(c, moe=replace(c.moe, dense_layers=()))


def qwen3_moe_config():
    """tiny-qwen3-moe as llama.cpp's qwen3moe graph runs it (every layer sparse, the top-k
    weights renormalized as Qwen3-30B-A3B's are), 256 wide so llama-quantize's Q4_K_M keeps
    K-quant superblocks: 2 layers, 4 q / 2 kv heads of 256 (one superblock of o_proj's
    contraction a head, so TP=2 and TP=3 cut it on whole blocks), 4 experts of width 256, top 2."""
    from tandem.models.presets import get_preset

    c = get_preset("tiny-qwen3-moe").config
    return replace(
        c, hidden_size=256, intermediate_size=256, num_hidden_layers=2, head_dim=256,
        moe=replace(c.moe, num_experts=4, intermediate_size=256, dense_layers=(),
                    norm_topk_prob=True),
    )  # fmt: skip


def mixtral_config():
    """tiny-mixtral with heads of 32 (4 q / 2 kv on a width of 128): o_proj's contraction is 4
    Q8_0 blocks, one a head, so TP=3 cuts it on whole blocks (2/1/1 heads)."""
    from tandem.models.presets import get_preset

    c = get_preset("tiny-mixtral").config
    return replace(c, hidden_size=128, head_dim=32)


FIXTURES = {  # name -> (preset, config, llama-quantize types)
    "gpt-oss": ("tiny-gpt-oss", gpt_oss_config, ("Q8_0", "MXFP4_MOE")),
    "phi3": ("tiny-phi3", phi3_config, ("Q8_0",)),
    "qwen2-moe": ("tiny-qwen2-moe", qwen2_moe_config, ("Q8_0", "BF16")),
    "qwen3-moe": ("tiny-qwen3-moe", qwen3_moe_config, ("Q4_K_M",)),
    "mixtral": ("tiny-mixtral", mixtral_config, ("Q8_0",)),
}


def convert(model_dir: Path, out: Path, cpp: Path) -> None:
    code = f"""
import runpy, sys
sys.path.insert(0, {str(cpp / "src")!r}); sys.path.insert(1, {str(cpp / "src" / "gguf-py")!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-4o"
import conversion.phi as phi
phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", {str(model_dir)!r}, "--outfile", {str(out)!r}, "--outtype", "f32"]
runpy.run_path({str(cpp / "src" / "convert_hf_to_gguf.py")!r}, run_name="__main__")
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def main(names: list[str]) -> None:
    from tandem.loaders.make import make_model_dir

    cpp = llamacpp()
    OUT.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(cpp / "bin"))
    for name, (preset, make_config, types) in FIXTURES.items():
        if names and name not in names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp) / name
            make_model_dir(d, preset, config=make_config())
            f32 = Path(tmp) / f"{name}-f32.gguf"
            convert(d, f32, cpp)
            for t in types:
                out = OUT / f"{name}-{t.lower()}.gguf"
                subprocess.run(
                    [str(cpp / "bin" / "llama-quantize"), str(f32), str(out), t, "1"],
                    check=True,
                    env=env,
                )
                print(out, out.stat().st_size)


if __name__ == "__main__":
    main(sys.argv[1:])
