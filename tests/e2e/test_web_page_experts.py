"""A mixture of experts' placement in `/v1/cluster` and on the page's cluster view: a live
`tandem serve --tp 2 --moe experts` of tiny-qwen3-moe (8 experts of 64 rows, 2 active; layer 1
dense) in float32, real processes on loopback, in a real headless Chromium (as `test_web_page`).

Each rank reports the experts its process loaded (`loaded`, gathered from its modules) beside the
plan's: rank 0 experts [0, 4), rank 1 [4, 8), all 64 rows of each; each holds 4 experts x 64 rows
x 3 x 64 x 4 bytes x 2 sparse layers = 393 216 B and reads per token its attention half, the
router, 2 x 4 / 8 = 1 expert's worth of each sparse layer and its rows of the dense layer. The page
shows both lines per rank, as text."""

import httpx
import pytest
from serve_support import make_model, running
from test_web_page import _by_id, _wait, browser  # noqa: F401 (the browser fixture)

from tandem.loaders.source import open_model

HELD = 4 * 64 * 3 * 64 * 4 * 2


def _bytes(n: float) -> str:
    """The page's `bytes()` (static/cluster.js)."""
    units, i = ["B", "KiB", "MiB", "GiB", "TiB"], 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.{1 if i else 0}f} {units[i]}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("moe") / "m", "tiny-qwen3-moe")
    args = ["serve", "--model", str(model), "--tp", "2", "--moe", "experts", "--max-batch", "2"]
    with running(args) as (_, base):
        yield base, model


def test_v1_cluster_reports_the_experts_each_rank_loaded(served):
    base, model = served
    ranks = httpx.get(base + "/v1/cluster", timeout=10).json()["ranks"]
    x = [r["experts"] for r in ranks]
    assert [e["experts"] for e in x] == [[0, 4], [4, 8]]
    assert [e["loaded"]["groups"] for e in x] == [[[0, 4, 64]], [[4, 8, 64]]]
    assert {e["moe"] for e in x} == {"experts"}
    assert [e["held_expert_bytes"] for e in x] == [HELD, HELD]
    assert [e["loaded"]["bytes"] for e in x] == [HELD, HELD]
    md = open_model(model)
    D = md.config.hidden_size
    router = 2 * md.info("model.layers.0.mlp.gate.weight").nbytes
    for e in x:
        assert e["active_experts"] == 1.0
        assert e["active_bytes"]["router"] == router
        assert e["active_bytes"]["experts"] == 2 * 64 * 3 * D * 4  # 1 expert x 2 sparse layers
        assert e["active_bytes_per_token"] == sum(e["active_bytes"].values())


def test_the_page_shows_each_ranks_experts_and_bytes_per_token(served, browser):  # noqa: F811
    base, _ = served
    want = [r["experts"] for r in httpx.get(base + "/v1/cluster", timeout=10).json()["ranks"]]
    browser.get(base + "/")
    _wait(browser, lambda d: _by_id(d, "cluster-state").text == "whole", timeout=60)

    def lines(d):
        got = d.execute_script(
            "return [...document.querySelectorAll('#ranks tbody tr[data-rank]')]"
            ".map((r) => [...r.querySelectorAll('.experts')].map((x) => x.textContent))"
        )
        return got if len(got) == 2 and all(len(g) == 2 for g in got) else None

    got = _wait(browser, lines, what="the expert lines")
    for (first, second), (a, b), e in zip(got, ([0, 4], [4, 8]), want):
        assert first == f"experts [{a}, {b}) (4) · 64 rows of each · whole experts"
        assert second == (
            f"reads {_bytes(e['active_bytes_per_token'])}/token · holds {_bytes(HELD)} of experts"
        )
    assert _bytes(HELD) == "384.0 KiB"
