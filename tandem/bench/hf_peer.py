"""The peer: Hugging Face transformers decoding the same model directory on this node.

    python -m tandem.bench.hf_peer --model DIR --prompt-len P --decode K [--dtype float32]

Prints one JSON object: TTFT (`generate` with one new token), decode tok/s from the difference
between K+1 and 1 new tokens (greedy, EOS ignored), and the greedy ids for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tandem.bench.timing import prompt_ids


def run(model_dir: str, prompt_len: int, n_decode: int, dtype: str, threads: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    ids = torch.tensor([prompt_ids(prompt_len, model.config.vocab_size)])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(n: int) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t0, out

    gen(2)  # warm-up
    ttft, _ = gen(1)
    total, out = gen(n_decode + 1)
    decode_s = (total - ttft) / n_decode
    return {
        "engine": f"transformers {__import__('transformers').__version__}",
        "dtype": dtype,
        "prompt_tokens": prompt_len,
        "decode_tokens": n_decode,
        "ttft_s": ttft,
        "prefill_tok_per_s": prompt_len / ttft,
        "decode_tok_per_s": 1.0 / decode_s,
        "token_ids": out[0, prompt_len:].tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.hf_peer")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    print(json.dumps(run(a.model, a.prompt_len, a.decode, a.dtype, a.threads)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
