"""Single-node decode and prefill speed: tandem vs Hugging Face `transformers.generate`, same weights,
same dtype, same thread count, measured side by side in one run, plus the memory-bandwidth roofline.

    .venv/bin/python scripts/bench/single_node.py [--model DIR] [--dtypes float32,bfloat16] [--threads 2]
                                          [--prompt-len 128] [--decode 32] [--repeats 3]

Without --model the `qwen3-0.6b` preset is written to /tmp/tandem-bench-qwen3-0.6b (once).
Both engines are timed the same way, in interleaved rounds (the machine may be shared): TTFT = wall
time of a generate call for 1 new token, decode tok/s = K / (time for K+1 new tokens - TTFT) within
the round; each figure is the median over --repeats rounds.
Roofline: weight bytes read per decode token (every layer matrix + the LM head, the embedding counted
once when tied; one embedding row is negligible) divided by a read bandwidth measured in every round,
same thread count, two ways: a read of the model's own weight tensors in place, the faster of
`sum` and the native 256-bit stream read (the roofline the fraction is quoted against: the very
bytes decode reads, where they lie in memory), and the same over a fresh 512 MiB float32 buffer
(printed beside it: on this VM a fresh buffer reads anywhere from 26 to 48 GB/s from one
allocation to the next, so it is a noisy ceiling).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.devices import DTYPE_NAMES
from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.kernels import native
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import ModelDir

DEFAULT_DIR = Path("/tmp/tandem-bench-qwen3-0.6b")


def best_read(tensors: list[torch.Tensor], threads: int, repeats: int, warm: bool) -> float:
    """Bytes/s of reading `tensors` in place: the faster of `sum` and the native 256-bit stream
    read (where built: on Zen 4 torch's 512-bit `sum` can read slower than 256-bit loads), each
    the median of `repeats` passes (after one untimed pass when `warm`)."""
    torch.set_num_threads(threads)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    readers = [lambda t: t.sum()] + ([native.stream_read] if native.available() else [])
    best = 0.0
    with torch.inference_mode():
        for read in readers:
            times = []
            for i in range(repeats + warm):
                t0 = time.perf_counter()
                for t in tensors:
                    read(t)
                if i or not warm:
                    times.append(time.perf_counter() - t0)
            best = max(best, nbytes / statistics.median(times))
    return best


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 7) -> float:
    """Bytes/s of reading a fresh `mib` MiB float32 buffer (`best_read`)."""
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return best_read([buf], threads, repeats, warm=True)


def weights_bandwidth(model: torch.nn.Module, threads: int, repeats: int = 3) -> float:
    """Bytes/s of reading every dense weight the decode reads (`decode_weights`) in place
    (`best_read`)."""
    ws = [p.detach() for p in decode_weights(model) if not p.is_mkldnn]
    return best_read(ws, threads, repeats, warm=False)


def decode_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every distinct parameter one decode token reads in full (an untied embedding reads one row)."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
            continue
        out.append(p)
    return out


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in decode_weights(model))


def prompt(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, min(vocab, 4000), (n,), generator=g).tolist()


Runner = Callable[[int], tuple[float, list[int]]]  # n new tokens -> (seconds, generated ids)


def tandem_runner(model, ids: list[int], k: int) -> Runner:
    ex = LocalExecutor(model, max_batch=1, max_seq_len=len(ids) + k + 1)

    def run(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        r = generate(ex, [ids], SamplingParams(max_tokens=n, temperature=0.0))[0]
        return time.perf_counter() - t0, r.token_ids

    return run


def hf_runner(model_dir: Path, dtype: torch.dtype, ids: list[int]) -> Runner:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    x = torch.tensor([ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t0, out[0, len(ids) :].tolist()

    return run


def measure(
    runners: dict[str, Runner], k: int, repeats: int, threads: int, model: torch.nn.Module
) -> dict:
    """Interleaved rounds (both bandwidths, then each engine's 1-token and (k+1)-token generate),
    so a shared machine's load drifts over all engines alike; per engine the median TTFT and the
    median of per-round decode rates k / (t(k+1) - t(1))."""
    for run in runners.values():
        run(2)  # warm-up
    ttft: dict[str, list[float]] = {n: [] for n in runners}
    rate: dict[str, list[float]] = {n: [] for n in runners}
    ids: dict[str, list[int]] = {}
    bws, wbws = [], []
    for _ in range(repeats):
        bws.append(read_bandwidth(threads, repeats=3))
        wbws.append(weights_bandwidth(model, threads))
        for name, run in runners.items():
            t1, _ = run(1)
            tk, ids[name] = run(k + 1)
            ttft[name].append(t1)
            rate[name].append(k / (tk - t1))
    med = statistics.median
    return dict(
        bw=med(bws),
        wbw=med(wbws),
        ttft={n: med(v) for n, v in ttft.items()},
        dec={n: med(v) for n, v in rate.items()},
        ids=ids,
    )


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
    print(
        f"model {model_dir} ({md.config.architecture}, {md.config.num_hidden_layers} layers), "
        f"threads {a.threads}, prompt {a.prompt_len}, decode {a.decode}, median of {a.repeats}",
        flush=True,
    )
    ids = prompt(a.prompt_len, md.config.vocab_size)
    for name in a.dtypes.split(","):
        dtype = DTYPE_NAMES[name]
        model = load_model(md, dtype=dtype)
        bytes_tok = weight_bytes_per_token(model)
        runners = {"tandem": tandem_runner(model, ids, a.decode)}
        if not a.skip_hf:
            runners["transformers"] = hf_runner(model_dir, dtype, ids)
        m = measure(runners, a.decode, a.repeats, a.threads, model)
        roof = m["wbw"] / bytes_tok
        row = dict(
            dtype=name,
            bw=m["bw"],
            wbw=m["wbw"],
            roof=roof,
            fresh_roof=m["bw"] / bytes_tok,
            gb=bytes_tok / 1e9,
            t_pre=a.prompt_len / m["ttft"]["tandem"],
            t_dec=m["dec"]["tandem"],
        )
        if not a.skip_hf:
            t_ids, h_ids = m["ids"]["tandem"], m["ids"]["transformers"]
            same = next((i for i, (x, y) in enumerate(zip(t_ids, h_ids)) if x != y), len(t_ids))
            row.update(
                h_pre=a.prompt_len / m["ttft"]["transformers"],
                h_dec=m["dec"]["transformers"],
                same=same,
            )
        print(_line(row), flush=True)
        del model, runners
        gc.collect()
    return 0


def _line(r: dict) -> str:
    s = (
        f"{r['dtype']:>9}: read bandwidth {r['wbw'] / 1e9:.2f} GB/s over the weights (fresh buffer "
        f"{r['bw'] / 1e9:.2f}), {r['gb']:.2f} GB/token, roofline {r['roof']:.2f} tok/s | tandem decode "
        f"{r['t_dec']:.2f} tok/s ({r['t_dec'] / r['roof']:.0%} of roofline; "
        f"{r['t_dec'] / r['fresh_roof']:.0%} of the fresh buffer's), prefill {r['t_pre']:.1f} tok/s"
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
