"""The quantized GEMV of two builds of csrc/ side by side in one process, against a plain read of
the same bytes: a git revision's kernels (`--old`, default HEAD) and the working tree's, each
compiled with tandem's flags into a temporary folder and loaded through ctypes.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/bench/qgemv_ab.py [GGUF] [--old REV] [--threads 1,2]
                                                  [--rounds 9] [--rows 1] [--types Q4_0,Q6_K]
                                                  [--shape N,K --calls 20]

Per ggml type present in the GGUF (default: the qwen3-0.6b Q4_0 file of vs_llamacpp.py), the
file's 2-d weights of that type (the dense F32, F16, BF16 only when `--types` names them),
each one `tandem_qgemv` call at `--rows` rows, as a decode token streams them; every round
runs old, new and the read (`tandem_stream_read`) of the same tensors back to back, so a busy
machine slows all three alike. Prints per type and thread count the median GB/s of each, their
fraction of the read, the median of the per-round new/old ratios and the best round of each
(on a busy machine the best rounds are the ones it ran alone).
`--shape N,K` replaces the file by one random (N, K) matrix of each of `--types`, called
`--calls` times per round: a small one stays in cache and shows the kernels' arithmetic rate.
`--repack`: the new build multiplies each Q8_0 weight repacked (a Q8_0X copy,
tandem/kernels/repack.py), the old one the file's rows, as a decode after load-time repacking
would; the read is of the repacked copy (the same bytes).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = Path.home() / ".cache/tandem-bench-gguf/qwen3-0.6b-Q4_0.gguf"


def build(src: Path, out: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """csrc/ at `src` compiled as tandem.kernels.native compiles it, loaded privately."""
    from tandem.kernels import native

    cc = native._compiler()
    srcs = [str(src / s.name) for s in native.SOURCES if (src / s.name).exists()]
    subprocess.run([cc, *native.FLAGS, *extra, "-o", str(out), *srcs, "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    for name in ("tandem_qgemv", "tandem_stream_read"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = native._SIGNATURES[name]
    return lib


def checkout_csrc(rev: str, dest: Path) -> Path:
    """csrc/ as of git revision `rev`, written under dest."""
    rel = "tandem/kernels/csrc"
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{rel}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    dest.mkdir(parents=True)
    for n in names:
        blob = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{rel}/{n}"], capture_output=True, check=True
        ).stdout
        (dest / n).write_bytes(blob)
    return dest


def weights(path: Path, types: set[str] | None) -> dict[str, list[tuple[np.ndarray, int, int]]]:
    """{type name: [(blocks (rows, row_bytes) uint8, type id, K), ...]} of the file's 2-d
    quantized weights, memory-mapped; dense ones (F32, F16, BF16) only where `types` names them."""
    import gguf

    out: dict[str, list] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        name = t.tensor_type.name
        dense = name in ("F32", "F16", "BF16")
        if len(t.shape) != 2 or (types and name not in types) or (dense and not types):
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        out.setdefault(name, []).append(
            (np.ascontiguousarray(t.data).view(np.uint8).reshape(n, -1), int(t.tensor_type), k)
        )
    return out


def synthetic(shape: str, types: list[str]) -> dict[str, list[tuple[np.ndarray, int, int]]]:
    """One random (N, K) matrix per type: random quant bytes, every float16 field 2^-7."""
    from tandem.models.quant.blocks import BY_NAME

    n, k = map(int, shape.split(","))
    rng = np.random.default_rng(1)
    out = {}
    for name in types:
        t = BY_NAME[name]
        blk = rng.integers(0, 256, (n * k // t.block_size, t.block_bytes), dtype=np.uint8)
        off = 0
        for _, kind, count in t.fields:
            size = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}[kind] * count
            if kind == "f16":
                blk[:, off : off + size] = np.full(count, 0x2000, np.uint16).view(np.uint8)
            off += size
        out[name] = [(blk.reshape(n, -1), t.type_id, k)]
    return out


class Part(ctypes.Structure):  # csrc/quant.h tq_part
    _fields_ = (("w", ctypes.c_void_p), ("rows", ctypes.c_int64), ("type", ctypes.c_int64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", nargs="?", default=str(DEFAULT))
    p.add_argument("--old", default="HEAD")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--types", default="")
    p.add_argument("--shape", default="")
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--old-flags", default="", help="extra compiler flags, e.g. -DQPREFETCH=2048")
    p.add_argument("--new-flags", default="")
    p.add_argument("--repack", action="store_true", help="new: Q8_0 weights as Q8_0X")
    a = p.parse_args()
    import torch  # the OpenMP runtime the kernels share, loaded first as in tandem

    from tandem.kernels import native, repack

    del torch
    tmp = Path(tempfile.mkdtemp(prefix="qgemv-ab-"))
    libs = {
        "old": build(checkout_csrc(a.old, tmp / "old"), tmp / "old.so", tuple(a.old_flags.split())),
        "new": build(ROOT / "tandem/kernels/csrc", tmp / "new.so", tuple(a.new_flags.split())),
    }
    if a.shape:
        groups = synthetic(a.shape, a.types.split(",") if a.types else ["Q4_0", "Q4_K", "Q6_K"])
    else:
        groups = weights(Path(a.gguf), set(a.types.split(",")) if a.types else None)
    rng = np.random.default_rng(0)
    for tname, ws in groups.items():
        ws = ws * a.calls
        total = sum(w.nbytes for w, _, _ in ws)
        calls, packed = [], {}
        for w, tid, k in ws:
            x = rng.standard_normal((a.rows, k)).astype(np.float32)
            y = np.empty((a.rows, w.shape[0]), np.float32)
            parts = (Part * 1)(Part(w.ctypes.data, w.shape[0], tid))
            wn, pn = w, parts
            if a.repack and tid == repack.Q8_0:
                if id(w) not in packed:  # one copy per weight (`--calls` repeats the same)
                    packed[id(w)] = np.empty_like(w)
                    pack = libs["new"].tandem_q8x_pack
                    pack.restype, pack.argtypes = native._SIGNATURES["tandem_q8x_pack"]
                    assert pack(w.ctypes.data, packed[id(w)].ctypes.data, w.shape[0], k, 2) == 0
                wn = packed[id(w)]
                pn = (Part * 1)(Part(wn.ctypes.data, w.shape[0], repack.Q8_0X))
            calls.append((x, y, {"old": parts, "new": pn}, k, wn))
        for nt in map(int, a.threads.split(",")):

            def gemv(side, nt=nt, calls=calls):
                lib = libs[side]
                for x, y, parts, k, _ in calls:
                    rc = lib.tandem_qgemv(
                        x.ctypes.data, parts[side], 1, None, y.ctypes.data, a.rows, k, 0, nt
                    )
                    assert rc == 0
                return calls[-1][1].copy()

            def read(nt=nt, calls=calls):
                for *_, w in calls:
                    libs["new"].tandem_stream_read(w.ctypes.data, w.nbytes, nt)

            ys = {n: gemv(n) for n in libs}  # warm-up, and the two agree
            diff = float(np.abs(ys["new"] - ys["old"]).max() / (np.abs(ys["old"]).max() + 1e-30))
            fns = {"old": lambda: gemv("old"), "new": lambda: gemv("new"), "read": read}
            times: dict[str, list[float]] = {n: [] for n in fns}
            for _ in range(a.rounds):
                for n, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    times[n].append(time.perf_counter() - t0)
            gbs = {n: total / statistics.median(t) / 1e9 for n, t in times.items()}
            best = {n: total / min(t) / 1e9 for n, t in times.items()}
            ratio = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
            print(
                f"{tname:5s} {len(ws):3d} tensors {total / 1e6:6.1f} MB threads {nt} rows {a.rows}: "
                f"read {gbs['read']:5.1f} GB/s, old {gbs['old']:5.1f} ({gbs['old'] / gbs['read']:.0%}), "
                f"new {gbs['new']:5.1f} ({gbs['new'] / gbs['read']:.0%}), new/old {ratio:.3f} "
                f"(max rel diff {diff:.1e}); best rounds: read {best['read']:.1f}, old "
                f"{best['old']:.1f}, new {best['new']:.1f}",
                flush=True,
            )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
