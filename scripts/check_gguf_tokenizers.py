"""Runs tandem's GGUF tokenizer on every golden vocab test of a llama.cpp source tree
(`models/ggml-vocab-NAME.gguf` with its `.inp` texts and `.out` ids, llama.cpp's test-tokenizer-0
cases) and prints the mismatches per vocabulary. Hand-run (the big vocabularies take a minute to
read); `tests/unit/test_gguf_tokenizer.py` runs two of them.

    python scripts/check_gguf_tokenizers.py [LLAMA_CPP_SRC] [NAME ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import gguf

from tandem.loaders.gguf.tokenizer import load_gguf_tokenizer
from tandem.loaders.gguf.tokenizer_fields import GGUFTokenizerError

DEFAULT_SRC = Path.home() / ".cache/tandem-llamacpp/src"


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else DEFAULT_SRC
    names = set(argv[1:])
    failed = 0
    for path in sorted((src / "models").glob("ggml-vocab-*.gguf")):
        name = path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        inp, out = Path(f"{path}.inp"), Path(f"{path}.out")
        if (names and name not in names) or not inp.exists():
            continue
        t0 = time.perf_counter()
        try:
            tok = load_gguf_tokenizer(gguf.GGUFReader(path), path)
        except GGUFTokenizerError as e:
            print(f"{name:16s} refused: {e}")
            continue
        texts = inp.read_text().split("\n__ggml_vocab_test__\n")
        wants = out.read_text().split("\n")
        bad = [t for t, w in zip(texts, wants) if tok.encode(t) != [int(x) for x in w.split()]]
        failed += len(bad)
        took = time.perf_counter() - t0
        print(f"{name:16s} {len(texts) - len(bad):3d}/{len(texts)} equal  ({took:.1f} s)")
        for t in bad[:3]:
            print(f"    differs on {t[:60]!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
