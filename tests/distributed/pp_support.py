"""Shared helpers for the pipeline tests: tiny configs, the single-node reference, a greedy loop."""

from __future__ import annotations

import torch

from tandem.config import ModelConfig
from tandem.engine.executor import Step, StepSequence
from tandem.models.llama import Transformer


def tiny_config(**kw) -> ModelConfig:
    base = dict(
        architecture="Qwen3ForCausalLM",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        qk_norm=True,
    )
    base.update(kw)
    return ModelConfig(**base)


def reference_model(config: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():  # a clear logit spread so greedy ids are not decided by near-ties
        model.lm_head.weight.mul_(4.0) if not config.tie_word_embeddings else None
    return model


def prompts(batch: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 7, 4][:batch]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def reference_greedy(model: Transformer, prompts: list[list[int]], n_new: int):
    """(first-step logits (B, vocab), generated ids per prompt) from full no-cache passes."""
    seqs = [list(p) for p in prompts]
    first = torch.stack([model(torch.tensor([s]))[0, -1].float() for s in seqs])
    for _ in range(n_new):
        for s in seqs:
            s.append(int(model(torch.tensor([s]))[0, -1].argmax()))
    return first, [s[len(p) :] for s, p in zip(seqs, prompts)]


def executor_greedy(executor, prompts: list[list[int]], n_new: int, base_id: int = 0):
    """The same through an `Executor`: one batched prefill step, then batched decode steps."""
    ids = [base_id + i for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    step = Step(tuple(StepSequence(i, tuple(p), 0) for i, p in zip(ids, prompts)))
    logits = executor.run(step).logits
    first = logits.clone()
    for k in range(n_new):
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        if k == n_new - 1:
            break
        step = Step(tuple(StepSequence(i, (s[-1],), len(s) - 1) for i, s in zip(ids, seqs)))
        logits = executor.run(step).logits
    executor.release(ids)
    return first, [s[len(p) :] for s, p in zip(seqs, prompts)]


def stage_model(
    ref: Transformer, layer_range, with_embed=False, with_head=False, dtype=torch.float32
):
    """A stage's slice of `ref` (same weights), in `dtype`."""
    m = Transformer(ref.config, layer_range, with_embed, with_head)
    state = ref.state_dict()
    own = m.state_dict()
    m.load_state_dict({k: state[k] for k in own}, strict=True)
    return m.to(dtype).eval()


def write_model(ref: Transformer, out) -> str:
    """`ref`'s weights as a model directory (config.json + model.safetensors)."""
    from tandem.loaders.writer import write_model_dir

    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if ref.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    write_model_dir(out, ref.config, state)
    return str(out)


@torch.inference_mode()
def mixed_reference_greedy(ref: Transformer, split: int, dtype1: torch.dtype, prompts, n_new: int):
    """Layers [0, split) + head in float32, layers [split, L) in `dtype1`, the hidden state crossing
    as float32 both ways: what a two-stage pipeline with a float32 wire computes (no cache)."""
    L = ref.config.num_hidden_layers
    head = stage_model(ref, (0, split), with_embed=True, with_head=True)
    tail = stage_model(ref, (split, L), dtype=dtype1)

    def logits(seq):
        x = torch.tensor([seq])
        ctx0 = head.context([0], [len(seq)])
        h = head.forward_layers(head.embed(x), ctx0).float()
        h = tail.forward_layers(h.to(dtype1), tail.context([0], [len(seq)])).float()
        return head.head(h)[0, -1].float()

    seqs = [list(p) for p in prompts]
    first = torch.stack([logits(s) for s in seqs])
    for _ in range(n_new):
        for s in seqs:
            s.append(int(logits(s).argmax()))
    return first, [s[len(p) :] for s, p in zip(seqs, prompts)]
