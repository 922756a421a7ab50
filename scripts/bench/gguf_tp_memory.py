"""Peak RSS and bytes read per TP rank vs single node, loading a GGUF file.

    python scripts/bench/gguf_tp_memory.py FILE.gguf [--tp 2] [--moe experts]

Each measurement runs in a fresh process: single node (`load_model`, every tensor), then each
rank r of a TP=N plan (`shard_transformer` + `load_shard`, its own blocks only). A rank's bytes
read are what `load_shard` returns (blocks + dense slices); single node's, every tensor's bytes.
Both are then put on the native kernels (`tandem.kernels.prepare`, as the engine does) and every
quantized projection multiplies one row once: each weight is streamed as a decode step streams
it (no collectives), and a mixture of experts' held experts each take one row (every held expert
read once). `--moe` places the experts as `generate --moe` does. Peak RSS is the process's VmHWM after that, minus the interpreter's
baseline before opening the file; also reported: the peak while opening the file (header parse,
the same on every rank), and the RSS split into anonymous memory and mapped file pages touched.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Solo:
    """Rank identity only: loading touches no collective."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def measure(path: str, tp: int, rank: int, moe: str = "tp") -> dict:
    import torch

    from tandem.kernels.prepare import prepare
    from tandem.kernels.quant_linear import QuantKernelLinear
    from tandem.loaders.load import load_model
    from tandem.loaders.source import open_model
    from tandem.models.moe import Experts
    from tandem.parallel.plan import plan_for_source
    from tandem.parallel.shard_load import load_shard, quant_types
    from tandem.parallel.transform import shard_transformer

    torch.set_num_threads(1)
    base, base_anon, base_file = _vm("VmRSS"), _vm("RssAnon"), _vm("RssFile")
    src = open_model(path)
    opened = _vm("VmHWM") - base
    if tp == 1:
        model = load_model(src)
        nbytes = sum(i.nbytes for i in src.manifest.values())
    else:
        plan = plan_for_source(src, tp, moe=moe)
        model = shard_transformer(src.config, plan, _Solo(rank, tp), qtypes=quant_types(src))
        nbytes = load_shard(model, src, plan, rank)
    prepare(model)  # the native quantized kernels over the blocks, as the engine runs them
    with torch.no_grad():  # every projection streams its weights once (a decode step's work)
        for m in model.modules():
            if isinstance(m, QuantKernelLinear):
                m(torch.randn(1, m.in_features))
            elif isinstance(m, Experts):  # one row through each held expert
                ids = torch.arange(m.first, m.first + m.count)[:, None]
                m(torch.randn(m.count, m.down_proj.out_features), torch.ones(m.count, 1), ids)
    file_bytes = sum(f.stat().st_size for f in src.files)
    return {
        "tp": tp,
        "rank": rank,
        "bytes_read": nbytes,
        "file_bytes": file_bytes,
        "peak_rss": _vm("VmHWM") - base,
        "rss_loaded": _vm("VmRSS") - base,
        "peak_opening": opened,
        "anon": _vm("RssAnon") - base_anon,
        "file_pages": _vm("RssFile") - base_file,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--moe", choices=("tp", "experts"), default="tp")
    ap.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, *args.one, args.moe)))
        return 0
    rows = []
    for tp, rank in [(1, 0), *((args.tp, r) for r in range(args.tp))]:
        cmd = [sys.executable, __file__, args.model, "--one", str(tp), str(rank), "--moe", args.moe]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    single = rows[0]
    for r in rows:
        print(
            f"tp={r['tp']} rank {r['rank']}: read {r['bytes_read'] / 1e6:.1f} MB "
            f"({r['bytes_read'] / r['file_bytes']:.2f} of the file), peak RSS "
            f"{r['peak_rss'] / 1e6:.1f} MB ({r['peak_rss'] / single['peak_rss']:.2f} of single; "
            f"{r['peak_opening'] / 1e6:.1f} MB of it opening the file), RSS at the end "
            f"{r['rss_loaded'] / 1e6:.1f} MB ({r['rss_loaded'] / single['rss_loaded']:.2f} of single)"
            f"; after the pass {r['anon'] / 1e6:.1f} MB anonymous + {r['file_pages'] / 1e6:.1f} MB "
            "of mapped file pages"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
