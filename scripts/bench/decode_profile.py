"""One decode token of a GGUF file on the torch-free path, op by op, against the machine's read of
the same bytes: where a token's time goes and how far each part is from the weight read.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/bench/decode_profile.py GGUF [--threads 2]
                                                    [--rounds 7] [--tokens 16]

Per round, each figure measured back to back (a busy machine slows them alike; medians over the
rounds are printed):
- token: the wall time of one greedy `DecodeToken` call (embedding, every layer, norm, head,
  argmax in one native call), and of the ctypes call alone (`python` = the difference);
- per projection kind (the layers' qkv, o, gate_up, down, and the head): one `tandem_qgemv` per
  layer through the kernel the model's choice routed it to (`LeanModel.kernel_choice`), the
  weights first evicted from every cache level (csrc/gemv.c tandem_evict) where the model's
  weights exceed the last-level cache (decode reads them from DRAM there), beside
  `tandem_stream_read` of the same bytes evicted alike: the kind's share of the roofline;
- argmax over the vocabulary's logits;
- rest = token - the GEMVs - argmax: attention, norms, RoPE, the embedding row, the threads'
  barriers.
Prints the kinds' GB/s, their fraction of the read, and the token's roofline (the read of all
its weights / the token's wall time).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()

    import numpy as np

    from tandem.kernels import cpu_isa, library, variant_choice
    from tandem.kernels.lean.model import LeanModel
    from tandem.loaders.gguf.model_file import GGUFModel

    th = a.threads
    model = LeanModel(GGUFModel(a.gguf), 1, 2 * a.rounds * a.tokens + 8, th)
    lib = library.library()
    dram = variant_choice.decode_reads_dram(model.projections())
    kinds = {
        k: [getattr(L, k) for L in model.layers if getattr(L, k) is not None]
        for k in ("qkv", "o", "gate_up", "down")
    }
    kinds["head"] = [model.head]

    def evict(lins) -> None:
        if dram:
            for lin in lins:
                for w in lin.arrays:
                    lib.tandem_evict(w.ctypes.data, w.nbytes)

    def gemv(lins) -> float:
        evict(lins)
        xs = [np.ones((1, lin.in_features), np.float32) for lin in lins]
        ys = [np.empty((1, lin.out_features), np.float32) for lin in lins]
        t0 = time.perf_counter()
        for lin, x, y in zip(lins, xs, ys, strict=True):
            lib.tandem_qgemv(x.ctypes.data, lin.desc.parts, lin.desc.nparts, lin.desc.bias,
                             y.ctypes.data, 1, lin.in_features, 0, th)  # fmt: skip
        return time.perf_counter() - t0

    def read(lins) -> float:
        evict(lins)
        t0 = time.perf_counter()
        for lin in lins:
            for w in lin.arrays:
                lib.tandem_stream_read(w.ctypes.data, w.nbytes, th)
        return time.perf_counter() - t0

    nbytes = {k: sum(w.nbytes for lin in v for w in lin.arrays) for k, v in kinds.items()}
    logits = np.random.default_rng(0).standard_normal(model.head.out_features).astype(np.float32)
    out = ctypes.c_int64()
    dt = model.decode_token
    fig: dict[str, list[float]] = {}

    def add(name: str, s: float) -> None:
        fig.setdefault(name, []).append(s)

    pos, tok = 0, 1
    for _ in range(a.rounds):
        walls, natives = [], []
        for _ in range(a.tokens):
            c, s, cl, sl = dt._rope(pos)
            t0 = time.perf_counter()
            tok = dt(0, pos, tok)
            walls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()  # the native call alone, on the next position
            pos += 1
            c, s, cl, sl = dt._rope(pos)
            lib.tandem_decode_token(dt.plan_ptr, tok, 0, pos, c, s, cl, sl, dt._greedy_ptr, 1)
            natives.append(time.perf_counter() - t0)
            pos += 1
        add("token", statistics.median(walls))
        add("native", statistics.median(natives))
        for k, lins in kinds.items():
            add(k, gemv(lins))
            add(k + " read", read(lins))
        t0 = time.perf_counter()
        lib.tandem_argmax(logits.ctypes.data, 1, logits.size, ctypes.byref(out), 0)
        add("argmax", time.perf_counter() - t0)

    med = {k: statistics.median(v) * 1e3 for k, v in fig.items()}
    choice = {n: c["decode"]["variant"] for n, c in model.kernel_choice["kernels"].items()}
    total = sum(nbytes.values())
    print(f"{a.gguf}: cpu {cpu_isa.cpu_model()}, threads {th}, decode kernels {choice}, "
          f"weights {total / 1e6:.0f} MB {'> LLC: from DRAM' if dram else '<= LLC'}")  # fmt: skip
    print(f"{'part':10} {'ms':>8} {'MB':>8} {'GB/s':>7} {'read GB/s':>9} {'of read':>7}")
    gemvs = 0.0
    for k in kinds:
        gemvs += med[k]
        mb = nbytes[k] / 1e6
        print(f"{k:10} {med[k]:8.3f} {mb:8.1f} {mb / med[k]:7.2f} {mb / med[k + ' read']:9.2f} "
              f"{med[k + ' read'] / med[k]:7.0%}")  # fmt: skip
    rest = med["token"] - gemvs - med["argmax"]
    reads = sum(med[k + " read"] for k in kinds)
    print(f"{'argmax':10} {med['argmax']:8.3f}")
    print(f"{'rest':10} {rest:8.3f}   (attention, norms, RoPE, embedding, barriers)")
    print(f"{'python':10} {med['token'] - med['native']:8.3f}   (wall - the native call)")
    print(f"{'token':10} {med['token']:8.3f}   {1e3 / med['token']:.1f} tok/s; roofline "
          f"{reads / med['token']:.0%} (read of all weights {reads:.3f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
