"""What the per-family process tests share (test_moe_processes, test_gemma3_processes,
test_phi3_processes, test_qwen35_processes): the prompts, the single node's greedy ids and first
logits at batch 1 and 3 (checked against transformers' own where the model is one of its),
TP groups started side by side, and the comparison every layout must pass: ids equal for 32
tokens, first logits within 1e-4."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from family_greedy import N_NEW, PROMPTS, assert_single_node, expected_greedy
from tp_support import SingleNode, close_concurrently, launch_concurrently

from tandem.engine.pp.launch import StageSpec, launch_pipeline
from tandem.parallel.partition import LayerRange as R

__all__ = [
    "PROMPTS",
    "assert_pipeline_and_grid_match",
    "assert_single_node",
    "expected_greedy",
    "tp_groups",
    "transformers_reference",
]


def transformers_reference(hf, d: Path) -> dict:
    """Save the transformers model `hf` to `d`, and the single node's `expected_greedy` on it,
    whose batch-1 ids must be transformers' own greedy ids."""
    hf.save_pretrained(d, safe_serialization=True)
    expected = expected_greedy(SingleNode(d))
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([PROMPTS[0]]), max_new_tokens=N_NEW, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    assert expected[1][0][0] == out[0, len(PROMPTS[0]) :].tolist()
    return expected


@contextmanager
def tp_groups(model, layouts: dict[str, tuple[int, dict]]) -> Iterator[dict]:
    """name -> a TP group over `model` of `layouts[name]` = (ranks, launch options), started
    side by side (4 sequences of 128 tokens, one thread a rank); closed on exit."""
    started = launch_concurrently(
        {k: (model, tp, kw) for k, (tp, kw) in layouts.items()},
        max_batch=4,
        max_seq_len=128,
        threads=1,
    )
    try:
        yield started
    finally:
        close_concurrently(started.values())


def assert_pipeline_and_grid_match(
    model, expected: dict, cut: int, layers: int, check=None, atol: float = 1e-4
) -> None:
    """Two stages cut at layer `cut`, then the same with the first stage a TP=2 group;
    `check(ex, stages)`, when given, also looks at each running pipeline; first logits within
    `atol` (`assert_single_node`)."""
    for stages in (
        [StageSpec(R(0, cut)), StageSpec(R(cut, layers))],
        [StageSpec(R(0, cut), tp=2), StageSpec(R(cut, layers), tp=1)],
    ):
        ex = launch_pipeline(model, stages, max_batch=4, max_seq_len=128, timeout=30, threads=1)
        try:
            assert_single_node(ex, expected, atol)
            if check is not None:
                check(ex, stages)
        finally:
            ex.close()
