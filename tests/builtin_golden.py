"""The built-in model's greedy continuation of its default prompt (`tandem generate` with no
arguments), pinned: a retrained or changed model must update these on purpose."""

GOLDEN_TOKENS = 24
GOLDEN_IDS: list[int] = [
    int(t)
    for t in "273 1272 4 472 292 947 16 223 380 273 1259 4 472 292 201 624 273 1259 4 472 292 947 16 201".split()
]
