"""Single-node decode and prefill speed: tandem vs Hugging Face `transformers.generate`, same weights,
same dtype, same thread count, measured side by side in one run, plus the memory-bandwidth roofline.

    .venv/bin/python bench/single_node.py [--model DIR] [--dtypes float32,bfloat16] [--threads 2]
                                          [--prompt-len 128] [--decode 32] [--repeats 3]

Without --model the `qwen3-0.6b` preset is written to /tmp/tandem-bench-qwen3-0.6b (once).
Both engines are timed the same way: TTFT = wall time of a generate call for 1 new token, decode
tok/s = K / (time for K+1 new tokens - TTFT); each figure is the median of --repeats runs.
Roofline: weight bytes read per decode token (every layer matrix + the LM head, the embedding counted
once when tied; one embedding row is negligible) divided by a read bandwidth measured in this run
(`sum` over a buffer far larger than the caches, same thread count).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem.devices import DTYPE_NAMES
from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import ModelDir

DEFAULT_DIR = Path("/tmp/tandem-bench-qwen3-0.6b")


def read_bandwidth(threads: int, mib: int = 1024, repeats: int = 7) -> float:
    """Bytes/s of a streaming read (`sum` over `mib` MiB of float32), median of `repeats`."""
    torch.set_num_threads(threads)
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
            continue  # untied embedding: one row read per token
        total += p.numel() * p.element_size()
    return total


def prompt(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, min(vocab, 4000), (n,), generator=g).tolist()


def time_tandem(model, ids: list[int], k: int, repeats: int) -> tuple[float, float, list[int]]:
    ex = LocalExecutor(model, max_batch=1, max_seq_len=len(ids) + k + 1)

    def run(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        r = generate(ex, [ids], SamplingParams(max_tokens=n, temperature=0.0))[0]
        return time.perf_counter() - t0, r.token_ids

    run(2)
    ttft = statistics.median(run(1)[0] for _ in range(repeats))
    totals, out = [], []
    for _ in range(repeats):
        t, out = run(k + 1)
        totals.append(t)
    return ttft, k / (statistics.median(totals) - ttft), out


def time_hf(model_dir: Path, dtype: torch.dtype, ids: list[int], k: int, repeats: int):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    x = torch.tensor([ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t0, out[0, len(ids) :].tolist()

    run(2)
    ttft = statistics.median(run(1)[0] for _ in range(repeats))
    totals, out = [], []
    for _ in range(repeats):
        t, out = run(k + 1)
        totals.append(t)
    return ttft, k / (statistics.median(totals) - ttft), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true", help="time tandem only")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model_dir = a.model or DEFAULT_DIR
    if not (model_dir / "config.json").exists():
        print(f"writing the qwen3-0.6b preset to {model_dir} ...", file=sys.stderr)
        make_model_dir(model_dir, "qwen3-0.6b", seed=0)
    md = ModelDir(model_dir)
    bw = read_bandwidth(a.threads)
    print(
        f"model {model_dir} ({md.config.architecture}, {md.config.num_hidden_layers} layers), "
        f"threads {a.threads}, prompt {a.prompt_len}, decode {a.decode}, median of {a.repeats}"
    )
    print(f"measured read bandwidth: {bw / 1e9:.2f} GB/s")
    ids = prompt(a.prompt_len, md.config.vocab_size)
    rows = []
    for name in a.dtypes.split(","):
        dtype = DTYPE_NAMES[name]
        model = load_model(md, dtype=dtype)
        bytes_tok = weight_bytes_per_token(model)
        roof = bw / bytes_tok
        t_ttft, t_dec, t_ids = time_tandem(model, ids, a.decode, a.repeats)
        del model
        gc.collect()
        row = dict(
            dtype=name, roof=roof, gb=bytes_tok / 1e9, t_pre=a.prompt_len / t_ttft, t_dec=t_dec
        )
        if not a.skip_hf:
            h_ttft, h_dec, h_ids = time_hf(model_dir, dtype, ids, a.decode, a.repeats)
            gc.collect()
            same = next((i for i, (x, y) in enumerate(zip(t_ids, h_ids)) if x != y), len(t_ids))
            row.update(h_pre=a.prompt_len / h_ttft, h_dec=h_dec, same=same)
        rows.append(row)
        print(_line(row), flush=True)
    return 0


def _line(r: dict) -> str:
    s = (
        f"{r['dtype']:>9}: {r['gb']:.2f} GB/token, roofline {r['roof']:.2f} tok/s | tandem decode "
        f"{r['t_dec']:.2f} tok/s ({r['t_dec'] / r['roof']:.0%} of roofline), prefill {r['t_pre']:.1f} tok/s"
    )
    if "h_dec" in r:
        s += (
            f" | transformers decode {r['h_dec']:.2f} tok/s ({r['h_dec'] / r['roof']:.0%}), prefill "
            f"{r['h_pre']:.1f} tok/s | ratio decode {r['t_dec'] / r['h_dec']:.2f}x, prefill "
            f"{r['t_pre'] / r['h_pre']:.2f}x | greedy ids equal for the first {r['same']} tokens"
        )
    return s


if __name__ == "__main__":
    sys.exit(main())
