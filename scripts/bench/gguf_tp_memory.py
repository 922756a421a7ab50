"""Peak RSS and bytes read per TP rank vs single node, loading a GGUF file.

    python scripts/bench/gguf_tp_memory.py FILE.gguf [--tp 2]

Each measurement runs in a fresh process: single node (`load_model`, every tensor), then each
rank r of a TP=N plan (`shard_transformer` + `load_shard`, its own blocks only). A rank's bytes
read are what `load_shard` returns (blocks + dense slices); single node's, every tensor's bytes.
Peak RSS is the process's VmHWM after loading and dequantizing q/o/down of every layer's local
shard once (the reference's per-step work, no collectives), minus the interpreter's baseline
before opening the file; also reported: the peak while opening the file (header parse, the same
on every rank) and the RSS once loaded (mapped pages touched + anonymous copies).
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


def measure(path: str, tp: int, rank: int) -> dict:
    import torch

    from tandem.loaders.load import load_model
    from tandem.loaders.source import open_model
    from tandem.parallel.plan import plan_for_source
    from tandem.parallel.shard_load import load_shard, quant_types
    from tandem.parallel.transform import shard_transformer

    torch.set_num_threads(1)
    base = _vm("VmRSS")
    src = open_model(path)
    opened = _vm("VmHWM") - base
    if tp == 1:
        model = load_model(src)
        nbytes = sum(i.nbytes for i in src.manifest.values())
    else:
        plan = plan_for_source(src, tp)
        model = shard_transformer(src.config, plan, _Solo(rank, tp), qtypes=quant_types(src))
        nbytes = load_shard(model, src, plan, rank)
    with torch.no_grad():  # every projection dequantizes once (the reference's per-step cost)
        for layer in model.model.layers.values():
            for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
                q = getattr(m, "quant", None) or m
                q.dequantized() if hasattr(q, "dequantized") else None
    file_bytes = sum(f.stat().st_size for f in src.files)
    return {
        "tp": tp,
        "rank": rank,
        "bytes_read": nbytes,
        "file_bytes": file_bytes,
        "peak_rss": _vm("VmHWM") - base,
        "rss_loaded": _vm("VmRSS") - base,
        "peak_opening": opened,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, *args.one)))
        return 0
    rows = []
    for tp, rank in [(1, 0), *((args.tp, r) for r in range(args.tp))]:
        cmd = [sys.executable, __file__, args.model, "--one", str(tp), str(rank)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    single = rows[0]
    for r in rows:
        print(
            f"tp={r['tp']} rank {r['rank']}: read {r['bytes_read'] / 1e6:.1f} MB "
            f"({r['bytes_read'] / r['file_bytes']:.2f} of the file), peak RSS "
            f"{r['peak_rss'] / 1e6:.1f} MB ({r['peak_rss'] / single['peak_rss']:.2f} of single; "
            f"{r['peak_opening'] / 1e6:.1f} MB of it opening the file), RSS after loading "
            f"{r['rss_loaded'] / 1e6:.1f} MB ({r['rss_loaded'] / single['rss_loaded']:.2f} of single)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
