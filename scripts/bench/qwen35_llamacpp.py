"""The Qwen3.5 hybrid (GGUF `qwen35`, `qwen35moe`) against llama.cpp on files llama.cpp's own
converter wrote: tandem's greedy ids against llama.cpp's (`llama-completion`) on the same file.

    PYTHONSAFEPATH=1 PYTHONPATH=. .venv/bin/python scripts/bench/qwen35_llamacpp.py \\
        [--shapes qwen35,qwen35moe] [--types F32,Q8_0,Q4_K_M] [--tokens 32] [--prompts 5,23,64]
        [--work DIR] [--writer-check] [--record]

Files (made once under --work, default ~/.cache/tandem-bench-gguf): a random transformers model
of each shape (`SHAPES`; weights spread as tests/hf_init.py's `spread_` does, so its logits are
not near-flat), saved as safetensors, converted to F32 by llama.cpp's `convert_hf_to_gguf.py`
(`--no-mtp`: no multi-token-prediction layers; a placeholder vocabulary of `<|i|>` tokens, so a
prompt of ids passes llama.cpp's tokenizer as those ids), then `llama-quantize`d to Q8_0 and
Q4_K_M. `--writer-check` also writes the HF folder with tandem's writer (F32) and names the
tensors and keys where that file and the converter's differ. The same files serve `vs_llamacpp.py --qwen35 --qwen35moe` (decode and prefill speed).

`--record` writes the test fixtures instead: the tiny shapes (`tiny-qwen35`, `tiny-qwen35moe`)
converted to F32 into tests/fixtures/gguf/, each with llama.cpp's greedy ids after two prompts
(`<file>.llamacpp.json`), which tests/equivalence/test_qwen35_converter_files.py holds tandem to
(CI has no llama.cpp).

Per file and prompt (`--prompts`: random ids, by default 5, 23 and 64 long): llama.cpp's greedy
continuation of `--tokens` ids, then tandem (the executor `tandem generate --device cpu` takes:
the torch-free path, F32 files included) stepped along llama.cpp's
sequence, one token a step after the prompt's prefill, taking its logits; for a quantized file
also the exact path along it (tandem's torch path on its reference modules: the file's blocks
dequantized, float32 products, no int8 activations). Prints how many leading ids tandem's greedy
choice equals llama.cpp's (a free-running tandem decode would give exactly those), how often each
engine's choice is the exact path's argmax, tandem's largest logit distance from the exact path
(the rounding its int8 activations add: llama.cpp's q8 activations add their own), and, where
tandem and llama.cpp part, the exact logits' gap from tandem's choice to llama.cpp's: a gap
within that rounding is a near-tie, not a layout error.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "tests")]  # PYTHONSAFEPATH
from vs_llamacpp import WORK, llamacpp, make_files  # noqa: E402

_COMMON = dict(
    vocab_size=32768, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, max_position_embeddings=4096, linear_num_key_heads=8,
    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    pad_token_id=0,
)  # fmt: skip
# Qwen3.5's layer shapes (gated attention with q/k heads of 256 and a quarter rotary, DeltaNet
# heads of 128 with twice as many v heads as q/k heads, so the converter tiles them) at ~0.5-0.75 B
SHAPES = {
    # 24 layers (18 DeltaNet, 6 attention), MLP 3584: ~0.53 B
    "qwen35": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
               dict(_COMMON, intermediate_size=3584, num_hidden_layers=24)),
    # 8 layers (6 DeltaNet, 2 attention), every FFN 48 experts of 512 with 8 active and a
    # sigmoid-gated shared expert of 512 (Qwen3.5-35B-A3B: 256 of 512, 8 active): ~0.74 B
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                  dict(_COMMON, num_hidden_layers=8, num_experts=48, num_experts_per_tok=8,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512)),
}  # fmt: skip


# The test fixtures' shapes (`--record`): both head widths 32 (llama.cpp takes the DeltaNet head
# widths from one key, so it reads only files whose k and v heads are as wide), 4 layers (DeltaNet
# on 0-2, gated attention on 3), 2 q/k heads serving 4 v heads (tiled by the converter), attention
# 2 q / 1 kv heads of 64 (16 rotary), an untied vocabulary of 512: 3.2 / 3.6 MB in F32.
_TINY = dict(
    _COMMON, vocab_size=512, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
    head_dim=64, max_position_embeddings=256, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=32, num_hidden_layers=4,
)  # fmt: skip
SHAPES["tiny-qwen35"] = ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                         dict(_TINY, intermediate_size=256))  # fmt: skip
SHAPES["tiny-qwen35moe"] = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                            dict(_TINY, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=64, shared_expert_intermediate_size=64))  # fmt: skip
FIXTURES = ROOT / "tests" / "fixtures" / "gguf"
RECORD_PROMPTS = (5, 23)  # the recorded prompts' lengths (random ids, seed 7)


def make_hf(shape: str):
    """A function writing `shape`'s random transformers model (float32 safetensors) to a folder."""

    def make(out: Path) -> None:
        import torch
        import transformers
        from hf_init import spread_

        arch, config, kw = SHAPES[shape]
        torch.manual_seed(0)
        model = getattr(transformers, arch)(getattr(transformers, config)(**kw)).eval()
        spread_(model)
        model.save_pretrained(out, safe_serialization=True)

    return make


def qwen35_files(work: Path, cpp: Path, shape: str, types) -> dict:
    """name -> `shape`'s GGUF file in each of `types`, converted by llama.cpp, made once."""
    name = f"{shape}-{'0.5b' if shape == 'qwen35' else '0.7b'}"
    return make_files(work, cpp, types=types, name=name, make_hf=make_hf(shape),
                      convert_args=("--no-mtp",), vocab="ids")  # fmt: skip


def record(cpp: Path, work: Path, tokens: int, threads: int) -> None:
    """The test fixtures (`tests/equivalence/test_qwen35_converter_files.py`): each tiny shape
    converted by llama.cpp to F32, copied to tests/fixtures/gguf/, with llama.cpp's greedy ids
    after each recorded prompt beside it (`<file>.llamacpp.json`)."""
    import json
    import shutil

    import numpy as np

    rng = np.random.default_rng(7)
    for shape in ("tiny-qwen35", "tiny-qwen35moe"):
        vocab = SHAPES[shape][2]["vocab_size"]
        prompts = [rng.integers(3, vocab - 1, n).tolist() for n in RECORD_PROMPTS]
        src = make_files(work, cpp, types=["F32"], name=shape, make_hf=make_hf(shape),
                         convert_args=("--no-mtp",), vocab="ids")[f"{shape} F32"]  # fmt: skip
        dst = FIXTURES / f"{shape}-converter-f32.gguf"
        shutil.copyfile(src, dst)
        runs = [{"prompt": p, "llama_cpp": llama_greedy(cpp, dst, p, tokens, threads)}
                for p in prompts]  # fmt: skip
        note = ("llama.cpp's greedy ids (llama-completion --temp 0, llama-cpp-python 0.3.36's "
                "vendored source) on this file, made by scripts/bench/qwen35_llamacpp.py --record")  # fmt: skip
        dst.with_suffix(".llamacpp.json").write_text(
            json.dumps({"note": note, "runs": runs}, indent=1) + "\n"
        )
        print(dst, dst.stat().st_size, [r["llama_cpp"][:8] for r in runs], flush=True)


def llama_greedy(cpp: Path, f: Path, prompt: list[int], tokens: int, threads: int) -> list[int]:
    """llama.cpp's greedy continuation of `prompt` (ids) on `f`, as ids: `llama-completion` at
    temperature 0 (the argmax), weights not repacked (the repacked AMX paths die with SIGILL /
    SIGSEGV on this VM, as llama-bench's prefill does)."""
    text = "".join(f"<|{i}|>" for i in prompt)
    out = subprocess.run(
        [str(cpp / "bin" / "llama-completion"), "-m", str(f), "-p", text, "-n", str(tokens),
         "--temp", "0", "--no-repack", "-t", str(threads), "-c", str(len(prompt) + tokens + 8),
         "-no-cnv", "--no-warmup", "--ignore-eos"],
        capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=str(cpp / "bin")),
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"llama-completion failed ({out.returncode}) on {f}: {out.stderr[-800:]}")
    ids = [int(x) for x in re.findall(r"<\|(\d+)\|>", out.stdout)]
    if ids[: len(prompt)] != prompt:  # it echoes the prompt as it tokenized it
        raise SystemExit(f"llama.cpp tokenized the prompt as {ids[: len(prompt) + 1]}")
    return ids[len(prompt) :]


def tandem_along(f: Path, prompt: list[int], theirs: list[int], threads: int, exact: bool):
    """tandem's logits (float64, one row a step) along prompt + `theirs`, and the executor's
    path: the one `tandem generate --device cpu` takes, or with `exact` the torch path on its
    reference modules (the file's blocks dequantized, float32 products: no activation rounding)."""
    import numpy as np

    from tandem.engine.executor import Step, StepSequence
    from tandem.engine.lean import lean_executor_for

    n = len(prompt) + len(theirs) + 1
    ex, path = None, "exact"
    if not exact:
        ex, path = (
            lean_executor_for(f, device="cpu", max_batch=1, max_seq_len=n, threads=threads),
            "lean",
        )
    if ex is None:
        import torch

        from tandem.engine.local import LocalExecutor

        torch.set_num_threads(threads)
        kernels = "torch" if exact else "auto"
        ex = LocalExecutor.from_dir(
            f, dtype=torch.float32, max_batch=1, max_seq_len=n, kernels=kernels
        )
        path = "exact" if exact else "torch"
    rows, feed, pos = [], tuple(prompt), 0
    for tok in theirs:
        rows.append(np.asarray(ex.run(Step((StepSequence(0, feed, pos),))).logits[0], np.float64))
        pos, feed = pos + len(feed), (tok,)
    ex.release([0])
    return np.stack(rows), path


def compare(theirs: list[int], ours, ref) -> str:
    """The line for one prompt: how many leading ids tandem's greedy choice equals llama.cpp's,
    how often each equals the exact path's (`ref`, None for an F32 file), and where tandem and
    llama.cpp part, the exact logits' gap from tandem's choice to llama.cpp's (a near-tie when it
    is within the rounding both engines add: tandem's measured distance from the exact logits)."""
    import numpy as np

    mine, t = ours.argmax(1), np.asarray(theirs)
    same = int(np.argmin(mine == t)) if (mine != t).any() else len(t)
    line = f"{same} of {len(t)} leading ids equal llama.cpp's"
    if ref is None:
        parts = [
            f"{i} (gap {ours[i, m] - ours[i, t[i]]:.3f})" for i, m in enumerate(mine) if m != t[i]
        ]
        return f"{line}; they part at {', '.join(parts) or 'no step'}"
    best, rows = ref.argmax(1), np.arange(len(t))
    gap = ref[rows, mine] - ref[rows, t]  # exact: tandem's choice over llama.cpp's
    part = [f"{i}:{gap[i]:+.3f}" for i in np.flatnonzero(mine != t)]
    return (f"{line}; equal the exact path's argmax: tandem {int((mine == best).sum())}, llama.cpp "
            f"{int((t == best).sum())} of {len(t)}; tandem's max |logit - exact| "
            f"{np.abs(ours - ref).max():.3f}; exact gaps where they part: {' '.join(part) or '-'}")  # fmt: skip


def writer_check(f32: Path, hf: Path) -> str:
    """tandem's writer (`write_model_dir_gguf`, F32) on the HF folder `hf` against llama.cpp's
    converter's F32 file `f32` of it: the tensors (names, shapes, bytes) and the architecture's
    keys that differ."""
    import tempfile

    import numpy as np
    from gguf import GGUFReader

    from tandem.loaders.gguf.writer import write_model_dir_gguf

    with tempfile.TemporaryDirectory() as d:
        (ours,) = write_model_dir_gguf(hf, Path(d) / "tandem-F32.gguf", "F32")
        a, b = GGUFReader(ours), GGUFReader(f32)
        ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
        diff = sorted(set(ta) ^ set(tb))
        diff += [n for n in sorted(set(ta) & set(tb)) if list(ta[n].shape) != list(tb[n].shape)
                 or not np.array_equal(ta[n].data, tb[n].data)]  # fmt: skip
        arch = str(b.fields["general.architecture"].contents())
        ka = {k: f.contents() for k, f in a.fields.items() if k.startswith(arch + ".")}
        kb = {k: f.contents() for k, f in b.fields.items() if k.startswith(arch + ".")}
        keys = {
            k: (ka.get(k), kb.get(k)) for k in sorted(set(ka) | set(kb)) if ka.get(k) != kb.get(k)
        }
    return (f"{len(tb)} tensors, differing: {diff or 'none'}; {arch}.* keys differing "
            f"(tandem, converter): {keys or 'none'}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen35,qwen35moe")
    p.add_argument("--types", default="F32,Q8_0,Q4_K_M")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompts", default="5,23,64", help="the prompts' lengths")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=WORK)
    p.add_argument(
        "--record",
        action="store_true",
        help="write the test fixtures (tiny shapes, F32) and llama.cpp's ids on them",
    )
    p.add_argument("--writer-check", action="store_true",
                   help="also compare tandem's writer's F32 file with the converter's")  # fmt: skip
    a = p.parse_args()
    import numpy as np

    cpp = llamacpp()
    if not (cpp / "bin" / "llama-completion").exists():
        raise SystemExit(f"build llama-completion: cmake --build {cpp}/build --target "
                         f"llama-completion, then copy build/bin/llama-completion to {cpp}/bin")  # fmt: skip
    if a.record:
        record(cpp, a.work, a.tokens, a.threads)
        return 0
    rng = np.random.default_rng(7)
    for shape in a.shapes.split(","):
        vocab = SHAPES[shape][2]["vocab_size"]
        prompts = [rng.integers(3, vocab - 1, int(n)).tolist() for n in a.prompts.split(",")]
        files = qwen35_files(a.work, cpp, shape, a.types.split(","))
        if a.writer_check:
            f32 = qwen35_files(a.work, cpp, shape, ["F32"]).popitem()[1]
            hf = f32.with_name(f32.name.replace("-F32.gguf", "-hf"))
            print(f"{shape}: tandem's writer against the converter: {writer_check(f32, hf)}")
        for name, f in files.items():
            for prompt in prompts:
                theirs = llama_greedy(cpp, f, prompt, a.tokens, a.threads)
                ours, path = tandem_along(f, prompt, theirs, a.threads, exact=False)
                ref = None
                if not name.endswith("F32"):
                    ref = tandem_along(f, prompt, theirs, a.threads, exact=True)[0]
                print(f"{name} [{path}] prompt {len(prompt)}: {compare(theirs, ours, ref)}",
                      flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
