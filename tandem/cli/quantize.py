"""`tandem quantize IN_DIR OUT.gguf --type q8_0|q4_0|q4_k|q4_k_m`: a Hugging Face safetensors
model written as one GGUF file that tandem and llama.cpp load, with its tokenizer and chat
template when the folder has a byte-level BPE `tokenizer.json`.

Matrices are packed per type by `models.quant.quantize` (Q8_0 / Q4_0 by gguf-py's own quantizers,
Q4_K by llama.cpp's min/scale search); norms and biases stay float32; `q4_k_m` is the Q4_K_M mix
(Q6_K attn_v and output, Q5_K attn_output and ffn_down). `--quantize TYPE` on `generate` / `serve`
builds the same blocks in memory instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tandem.config import ConfigError
from tandem.loaders.gguf.quantized_dir import QTYPES, QuantizeChoiceError, writer_qtype
from tandem.loaders.gguf.writer import GGUFWriteError, write_model_dir_gguf
from tandem.loaders.safetensors_dir import ModelFileError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a safetensors model directory as a quantized GGUF")
    p.add_argument("model_dir", help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--type", required=True, choices=sorted(QTYPES), help="block type")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix != ".gguf":
        print(f"tandem quantize: error: {out}: the output must end in .gguf", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        (written,) = write_model_dir_gguf(args.model_dir, out, writer_qtype(args.type))
    except (ModelFileError, ConfigError, GGUFWriteError, QuantizeChoiceError) as e:
        print(f"tandem quantize: error: {e}", file=sys.stderr)
        return 2
    size = written.stat().st_size
    print(
        f"wrote {written} ({args.type}, {size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f}s"
    )
    return 0
