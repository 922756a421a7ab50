"""Trains tandem's built-in model on CPython's reference text and writes it in the HF layout.

    .venv/bin/python scripts/train_builtin.py            # the shipped model (15-20 min on 2 cores)
    .venv/bin/python scripts/train_builtin.py --steps 5 --out /tmp/m   # a smoke run

The model is `tandem.models.llama.Transformer` itself (Qwen3 layout: GQA, q/k RMSNorm, tied
embeddings), trained through its no-cache causal forward with AdamW and a cosine schedule. Every
source of randomness is seeded and torch runs with 2 threads and deterministic algorithms, so the same
Python (same `pydoc_data`, checked by hash), torch and seed give the same weights.

It prints the held-out cross-entropy next to a unigram baseline's (the held-out tokens scored under
the training set's token frequencies, add-one smoothed), both over exactly the same target tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import builtin_corpus as corpus  # noqa: E402

from tandem.config import ModelConfig  # noqa: E402
from tandem.models.llama import Transformer  # noqa: E402

NAME = "pydoc-qwen3-5m"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tandem" / "builtin" / NAME
# The corpus the shipped weights were trained on (CPython 3.11.7's pydoc_data.topics).
EXPECTED_CORPUS_SHA256 = "4594d824487ea711258725d3dd158b2a0bfdea6bccd9f358421913684e2dfcfd"
VOCAB_SIZE = 4096
SEQ_LEN = 512


def model_config(vocab_size: int, eos_ids: tuple[int, ...], bos_id: int) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=SEQ_LEN,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        qk_norm=True,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        torch_dtype="float32",
    )


def init_weights(model: Transformer, seed: int) -> None:
    """GPT-2 style: N(0, 0.02) for every matrix and the (tied) embedding, output projections of the
    residual branches scaled by 1/sqrt(2 * layers); norms start at one."""
    g = torch.Generator().manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            std = 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=g) * std)


def unigram_cross_entropy(train_ids: torch.Tensor, targets: torch.Tensor, vocab: int) -> float:
    """Mean -log p(t) of `targets` under add-one-smoothed token frequencies of `train_ids`."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[targets].mean())


def held_out_windows(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Non-overlapping windows of seq_len + 1 tokens (the last may be shorter) covering `ids`."""
    return [ids[i : i + seq_len + 1] for i in range(0, len(ids) - 1, seq_len)]


@torch.no_grad()
def evaluate(model: Transformer, windows: list[torch.Tensor]) -> float:
    model.eval()
    total, n = 0.0, 0
    for w in windows:
        logits = model(w[None, :-1])  # (1, T, V)
        total += float(F.cross_entropy(logits[0].float(), w[1:], reduction="sum"))
        n += len(w) - 1
    model.train()
    return total / n


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def write_hf_dir(model: Transformer, config: ModelConfig, tok, out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")  # HF convention: a tied head is not stored
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    corpus.save_tokenizer(tok, out, config.max_position_embeddings)
    gen = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": config.eos_token_ids[0],
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_new_tokens": 200,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--allow-other-corpus",
        action="store_true",
        help="train even if this Python's pydoc_data differs from the shipped model's corpus",
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    data = corpus.build_corpus()
    if data.sha256 != EXPECTED_CORPUS_SHA256 and not args.allow_other_corpus:
        raise corpus.CorpusError(
            f"pydoc_data.topics on Python {data.python_version} hashes to {data.sha256}, not the "
            f"shipped model's corpus {EXPECTED_CORPUS_SHA256} (CPython 3.11.7); pass "
            "--allow-other-corpus to train on it anyway"
        )
    tok = corpus.train_tokenizer(data.train_documents(), VOCAB_SIZE)
    eot, im_end = tok.token_to_id(corpus.EOS), tok.token_to_id(corpus.IM_END)
    train_ids = torch.tensor(
        [i for d in data.train_documents() for i in tok.encode(d).ids], dtype=torch.int64
    )
    held_ids = torch.tensor(
        [i for d in data.held_out_documents() for i in tok.encode(d).ids], dtype=torch.int64
    )
    windows = held_out_windows(held_ids, SEQ_LEN)
    targets = torch.cat([w[1:] for w in windows])
    unigram = unigram_cross_entropy(train_ids, targets, tok.get_vocab_size())

    config = model_config(tok.get_vocab_size(), (eot, im_end), eot)
    model = Transformer(config)
    init_weights(model, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"corpus sha256 {data.sha256} (Python {data.python_version}): {len(train_ids)} train "
        f"tokens, {len(targets)} held-out targets; model {n_params / 1e6:.2f} M params",
        flush=True,
    )
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(args.seed)
    warmup = max(1, min(50, args.steps // 10))
    t0 = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup, args.lr / 20)
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (args.batch,), generator=g)
        batch = torch.stack([train_ids[s : s + SEQ_LEN + 1] for s in starts.tolist()])
        logits = model(batch[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step + 1 == args.steps
        if step % 10 == 0 or last:
            rate = (step + 1) / (time.time() - t0)
            print(f"step {step:5d} loss {loss.item():.4f} ({rate:.2f} steps/s)", flush=True)
        if args.eval_every and ((step + 1) % args.eval_every == 0) and not last:
            print(f"step {step + 1:5d} held-out {evaluate(model, windows):.4f}", flush=True)
    held = evaluate(model, windows)
    elapsed = time.time() - t0
    print(
        f"held-out cross-entropy {held:.4f} nats/token vs unigram baseline {unigram:.4f} "
        f"(perplexity {math.exp(held):.1f} vs {math.exp(unigram):.1f}); {elapsed:.0f} s",
        flush=True,
    )
    report = {
        "name": NAME,
        "corpus": "pydoc_data.topics (CPython reference text, PSF License)",
        "corpus_sha256": data.sha256,
        "python_version": data.python_version,
        "torch_version": torch.__version__,
        "split": f"section i held out when i % {corpus.HELD_OUT_EVERY} == {corpus.HELD_OUT_PHASE}",
        "train_tokens": len(train_ids),
        "held_out_tokens": len(targets),
        "parameters": n_params,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": SEQ_LEN,
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "train_seconds": round(elapsed),
        "held_out_cross_entropy": round(held, 4),
        "unigram_cross_entropy": round(unigram, 4),
    }
    write_hf_dir(model, config, tok, args.out, report)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
