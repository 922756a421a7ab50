"""Decode GEMV kernels side by side: GB/s of weights streamed over one token's matrices, against a
plain read (`sum`) of the same matrices, same thread count, in interleaved rounds.

    .venv/bin/python scripts/bench/gemv.py [--preset qwen3-0.6b] [--dtypes float32,bfloat16] [--threads 2]
                                   [--rounds 7] [--rows 1]

The matrices are the preset's per-token set (fused q/k/v and gate/up as tandem runs them, o, down,
per layer, and the LM head), random, each its own allocation. Kernels: `native` (gemv.c),
`onednn` (f32 on the dense weight) or `packed` (bf16 reordered), and `F.linear`. Prints the
median GB/s of each and its fraction of a plain read of the same matrices: the faster of `sum`
and the native 256-bit stream read (`native.stream_read`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tandem.devices import DTYPE_NAMES
from tandem.kernels import native
from tandem.kernels.linear import PACKED, pack_weight
from tandem.models.presets import get_preset


def token_matrices(preset: str) -> list[tuple[int, int]]:
    """(out, in) of every matrix one decode token reads, in order."""
    c = get_preset(preset).config
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    return layer * c.num_hidden_layers + [(c.vocab_size, h)]


def kernels(dtype: torch.dtype) -> dict:
    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    ks = {"F.linear": (lambda w: w, F.linear)}
    if dtype == torch.float32:
        ks["onednn"] = (lambda w: w, onednn)
    elif dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported():
        ks["packed"] = (lambda w: pack_weight(w, PACKED), onednn)
    if native.available():
        ks["native"] = (lambda w: w, native.gemv)
    return ks


def run(shapes, dtype, rows: int, rounds: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    dense = [(torch.randn(s, generator=g) * 0.02).to(dtype) for s in shapes]
    total = sum(w.numel() * w.element_size() for w in dense)
    xs = {k: torch.randn(rows, k).to(dtype) for k in {s[1] for s in shapes}}
    forms = {name: ([prep(w) for w in dense], fn) for name, (prep, fn) in kernels(dtype).items()}
    ins = [xs[s[1]] for s in shapes]

    def call(ws, fn):
        return lambda: [fn(x, w) for x, w in zip(ins, ws)]

    fns = {"sum": call(dense, lambda x, w: w.sum())}
    if native.available():
        fns["stream"] = call(dense, lambda x, w: native.stream_read(w))
    fns |= {n: call(ws, fn) for n, (ws, fn) in forms.items()}
    times: dict[str, list[float]] = {n: [] for n in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(rounds):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    return {n: total / statistics.median(t) / 1e9 for n, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--rows", type=int, default=1, help="decode batch (X rows)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shapes = token_matrices(a.preset)
    print(
        f"{a.preset}: {len(shapes)} matrices per token, threads {a.threads}, rows {a.rows}, "
        f"median of {a.rounds}; native: {f'AVX-{native.isa()}' if native.available() else native.why()}"
    )
    with torch.inference_mode():
        for name in a.dtypes.split(","):
            gbs = run(shapes, DTYPE_NAMES[name], a.rows, a.rounds)
            print(f"{name:>9}: {_cells(gbs)}", flush=True)
    return 0


def _cells(gbs: dict[str, float]) -> str:
    read = max(gbs["sum"], gbs.get("stream", 0.0))  # the read ceiling: the faster plain read
    parts = [f"read {read:.1f} GB/s (sum {gbs['sum']:.1f}, stream {gbs.get('stream', 0):.1f})"]
    parts += [f"{n} {v:.1f} ({v / read:.0%})" for n, v in gbs.items() if n not in ("sum", "stream")]
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
