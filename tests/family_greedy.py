"""The comparison every layout of a model family must pass against its single node, in process or
across processes: greedy ids for N_NEW tokens at batch 1 and 3 equal, first (prefill) logits within
1e-4 (a family whose recurrence carries one step's rounding into every later state may state a
wider bound, with its reason). Shared by tests/distributed/family_support.py and the in-process placement tests."""

from __future__ import annotations

from tp_support import greedy

PROMPTS = [[5, 17, 33, 2, 8, 100, 7], [40, 41, 300], [9, 9, 9, 1, 2, 3, 4, 70, 11, 12]]
N_NEW = 32
BATCHES = (1, 3)


def expected_greedy(ex) -> dict:
    """batch -> (greedy ids, first logits) of `ex` (the single node)."""
    return {b: greedy(ex, PROMPTS[:b], N_NEW) for b in BATCHES}


def assert_single_node(ex, expected: dict, atol: float = 1e-4) -> None:
    for batch in BATCHES:
        ids, first = greedy(ex, PROMPTS[:batch], N_NEW)
        want_ids, want_first = expected[batch]
        worst = (first - want_first).abs().max().item()
        assert worst < atol, f"batch {batch}: first logits {worst:.3g} from single node's"
        assert ids == want_ids, f"batch {batch}"
