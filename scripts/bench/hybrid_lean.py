"""Decode and prefill of a Qwen3.5-shaped hybrid (Gated DeltaNet on 3 of every 4 layers) on one
node, per GGUF type: tandem's torch-free path (`LeanExecutor`: each DeltaNet layer one native
call a decode token, csrc/deltanet.c) against tandem's torch path on the same file
(`LocalExecutor`) and transformers in float32 on the same random weights, the same threads,
interleaved round by round in one process (a busy machine shifts all alike). transformers (its
PyTorch path: no flash-linear-attention or causal-conv1d kernels on a CPU) is the outside peer
here; against llama.cpp on its own converter's files: `vs_llamacpp.py --qwen35 --qwen35moe`.

    PYTHONSAFEPATH=1 PYTHONPATH=. .venv/bin/python scripts/bench/hybrid_lean.py \
        [--types Q4_K_M,Q8_0] [--threads 2] [--rounds 3] [--prompt 128] [--tokens 16]

The shape is scripts/bench/hybrid_vs_transformers.py's `SHAPE` (hidden 1024, 12 layers: 9
DeltaNet, 3 gated attention; DeltaNet 8 q/k heads of 128 serving 16 v heads of 128; MLP 3072;
0.26 B parameters). Q4_K_M is tandem's writer's Q4_K_M mix (`K_MIX`). Per round and executor:
one prefill of `--prompt` tokens, then `--tokens` greedy decode steps. Prints the medians and
the median per-round ratios (above 1: the torch-free path is faster), and whether the greedy ids
of the three agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # PYTHONSAFEPATH leaves it out
from hybrid_vs_transformers import SHAPE  # noqa: E402

WRITER_TYPE = {"Q4_K_M": "K_MIX", "Q8_0": "Q8_0"}


def _tandem_run(ex, sid: int, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
    from tandem.engine.executor import Step, StepSequence

    t0 = time.perf_counter()
    tok = int(ex.run(Step((StepSequence(sid, tuple(prompt), 0),), greedy=True)).token_ids[0])
    t1 = time.perf_counter()
    ids = [tok]
    for i in range(tokens):
        step = Step((StepSequence(sid, (tok,), len(prompt) + i),), greedy=True)
        tok = int(ex.run(step).token_ids[0])
        ids.append(tok)
    t2 = time.perf_counter()
    ex.release([sid])
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / tokens, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q4_K_M,Q8_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    import torch
    import transformers

    from tandem.engine.lean import LeanExecutor
    from tandem.engine.local import LocalExecutor
    from tandem.loaders.gguf.writer import write_model_dir_gguf

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE)).eval()
    prompt = torch.randint(1, SHAPE["vocab_size"], (a.prompt,), generator=torch.Generator())
    prompt_ids = prompt.tolist()
    seq = a.prompt + a.tokens + 1

    @torch.inference_mode()
    def theirs() -> tuple[float, float, list[int]]:
        t0 = time.perf_counter()
        out = hf(input_ids=prompt[None], use_cache=True)
        t1 = time.perf_counter()
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        ids = [int(tok)]
        for _ in range(a.tokens):
            out = hf(input_ids=tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            ids.append(int(tok))
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / a.tokens, ids

    med = statistics.median
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(Path(d) / "hf", safe_serialization=True)
        for qtype in a.types.split(","):
            (f,) = write_model_dir_gguf(
                Path(d) / "hf", Path(d) / f"{qtype}.gguf", WRITER_TYPE[qtype]
            )
            mib = f.stat().st_size / 2**20
            lean = LeanExecutor.from_file(f, max_batch=1, max_seq_len=seq, threads=a.threads)
            local = LocalExecutor.from_dir(f, max_batch=1, max_seq_len=seq)
            rows = []
            for r in range(a.rounds):
                runs = (_tandem_run(lean, r, prompt_ids, a.tokens),
                        _tandem_run(local, r, prompt_ids, a.tokens), theirs())  # fmt: skip
                rows.append(runs)
                print(
                    f"{qtype} round {r}: prefill ms lean/torch/transformers "
                    f"{runs[0][0]:.0f}/{runs[1][0]:.0f}/{runs[2][0]:.0f}; decode ms/token "
                    f"{runs[0][1]:.1f}/{runs[1][1]:.1f}/{runs[2][1]:.1f}",
                    flush=True,
                )
            same = [rows[0][0][2] == rows[0][k][2] for k in (1, 2)]
            print(f"{qtype} ({mib:.0f} MiB): greedy ids equal torch path {same[0]}, "
                  f"transformers {same[1]}")  # fmt: skip
            for k, what in ((0, f"prefill {a.prompt} (ms)"), (1, "decode (ms/token)")):
                m = [med(row[j][k] for row in rows) for j in range(3)]
                rt = [med(row[j][k] / row[0][k] for row in rows) for j in (1, 2)]
                print(
                    f"{qtype} {what}: lean {m[0]:.1f}, torch path {m[1]:.1f}, transformers "
                    f"{m[2]:.1f}; torch/lean {rt[0]:.2f}x, transformers/lean {rt[1]:.2f}x"
                )
            del lean, local


if __name__ == "__main__":
    main()
