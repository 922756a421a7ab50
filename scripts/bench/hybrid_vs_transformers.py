"""Prefill and decode of a Qwen3.5-shaped hybrid (Gated DeltaNet on 3 of every 4 layers) on one
node: tandem's single-node executor against transformers on the same random weights, the same
dtype and the same threads, interleaved round by round in one process (a busy machine shifts both
alike). transformers (its PyTorch reference path: no flash-linear-attention or causal-conv1d
kernels on a CPU) is the peer here; against llama.cpp: `vs_llamacpp.py --qwen35 --qwen35moe`.

    PYTHONSAFEPATH=1 PYTHONPATH=. .venv/bin/python scripts/bench/hybrid_vs_transformers.py \
        [--threads 2] [--rounds 3] [--prompt 128] [--tokens 16] [--dtype float32] [--kernels auto]

The shape (`SHAPE`): hidden 1024, 12 layers (9 DeltaNet, 3 gated attention), 8 query / 2 kv heads
of 128, DeltaNet 8 q/k heads of 128 serving 16 v heads of 128, conv window 4, MLP 3072, 32768
tokens (about 0.26 B parameters). Per round: one prefill of `--prompt` tokens, then `--tokens`
greedy decode steps, first tandem then transformers (each with its own cache); prints the median
ms of each and the median of the per-round ratios (transformers / tandem: above 1, tandem is
faster).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

SHAPE = dict(
    vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
    bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--kernels", default="auto", help="tandem's linear kernels: auto or torch")
    a = p.parse_args()
    import torch
    import transformers

    from tandem.engine.executor import Step, StepSequence
    from tandem.engine.local import LocalExecutor

    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        ex = LocalExecutor.from_dir(
            d, dtype=dtype, max_batch=1, max_seq_len=a.prompt + a.tokens, kernels=a.kernels
        )
    hf = hf.to(dtype)
    prompt = torch.randint(1, SHAPE["vocab_size"], (a.prompt,), generator=torch.Generator())

    def ours(sid: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        out = ex.run(Step((StepSequence(sid, tuple(prompt.tolist()), 0),), greedy=True))
        t1 = time.perf_counter()
        tok = int(out.ids()[0])
        for i in range(a.tokens):
            pos = a.prompt + i
            tok = int(ex.run(Step((StepSequence(sid, (tok,), pos),), greedy=True)).ids()[0])
        t2 = time.perf_counter()
        ex.release([sid])
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / a.tokens

    @torch.inference_mode()
    def theirs() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = hf(input_ids=prompt[None], use_cache=True)
        t1 = time.perf_counter()
        cache = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(a.tokens):
            out = hf(input_ids=tok, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / a.tokens

    rows = []
    for r in range(a.rounds):
        o, t = ours(r), theirs()
        rows.append((o, t))
        print(
            f"round {r}: prefill tandem {o[0]:.0f} ms, transformers {t[0]:.0f} ms; "
            f"decode tandem {o[1]:.1f} ms/token, transformers {t[1]:.1f} ms/token"
        )
    med = statistics.median
    for k, what in ((0, f"prefill {a.prompt} tokens (ms)"), (1, "decode (ms/token)")):
        ratio = med(t[k] / o[k] for o, t in rows)
        print(
            f"{what}: tandem {med(o[k] for o, _ in rows):.1f}, transformers "
            f"{med(t[k] for _, t in rows):.1f}, transformers/tandem {ratio:.2f}x"
        )


if __name__ == "__main__":
    main()
