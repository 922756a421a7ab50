"""`tandem plan`'s predictor: exact figures for small hand-checkable cases."""

from types import SimpleNamespace

import pytest

from tandem.parallel.partition import model_cost
from tandem.plan.model import (
    CONTROL_BYTES,
    Layout,
    LinkSpec,
    NodeSpec,
    PlanModelError,
    allreduce_s,
    candidate_layouts,
    layer_shares,
    parse_duration,
    parse_node,
    parse_rate,
    predict,
    rank_layouts,
)

CFG = SimpleNamespace(
    hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
    intermediate_size=256, vocab_size=256, num_hidden_layers=4, tie_word_embeddings=True,
)  # fmt: skip
S = 4 * CFG.hidden_size  # one f32 hidden state
LINK = LinkSpec(rtt_s=100e-6, goodput_bytes_per_s=1e6, overhead_s=10e-6)
FREE = LinkSpec(rtt_s=0.0, goodput_bytes_per_s=1e30)


def _fractions():
    c = model_cost(CFG)
    read = c.num_layers * c.layer_params + c.head_compute_params
    return c.layer_params / read, c.head_compute_params / read


def test_single_node_prediction_is_the_nodes_own_speed_with_no_wire():
    p = predict(CFG, Layout(), [NodeSpec("a", 0.01)], LINK)
    assert p.s_per_token == pytest.approx(0.01)
    assert p.sync_s == 0 and p.wire_bytes_per_token == 0


def test_tp2_on_two_machines_halves_compute_and_pays_every_allreduce():
    nodes = [NodeSpec("a", 0.01), NodeSpec("b", 0.01)]
    p = predict(CFG, Layout(tp=2), nodes, LINK)
    assert p.compute_s == pytest.approx(0.005)
    ar = LINK.message_s(S)  # a small tensor: one all-gather hop of the whole tensor
    pairs = 4 * 2 * 2  # the greedy argmax: one (max, index) pair per rank, never the logits
    expected_sync = (2 * 4 + 1) * ar + LINK.message_s(CONTROL_BYTES) + LINK.message_s(pairs)
    assert p.sync_s == pytest.approx(expected_sync)
    assert p.wire_bytes_per_token == (2 * 4 + 1) * 2 * S + 2 * pairs + CONTROL_BYTES


def test_ranks_sharing_one_machine_do_not_speed_up_compute():
    nodes = [NodeSpec("a", 0.01, host="box"), NodeSpec("b", 0.01, host="box")]
    assert predict(CFG, Layout(tp=2), nodes, FREE).compute_s == pytest.approx(0.01)
    assert predict(CFG, Layout(pp=2), nodes, FREE).compute_s == pytest.approx(0.01)


def test_pp2_one_stream_runs_stages_in_turn_and_ships_one_activation_per_boundary():
    nodes = [NodeSpec("a", 0.01), NodeSpec("b", 0.01)]
    p = predict(CFG, Layout(pp=2), nodes, LINK)
    assert p.compute_s == pytest.approx(0.01)
    assert p.sync_s == pytest.approx(2 * LINK.message_s(S))
    assert p.wire_bytes_per_token == 2 * S
    assert sum(p.stage_layers) == 4 and p.stage_layers[0] <= p.stage_layers[1]


def test_pp_stage_compute_follows_each_nodes_speed():
    frac_layer, frac_head = _fractions()
    nodes = [NodeSpec("fast", 0.01), NodeSpec("slow", 0.03)]
    p = predict(CFG, Layout(pp=2), nodes, FREE)
    n0, n1 = p.stage_layers
    expected = n0 * 0.01 * frac_layer + 0.01 * frac_head + n1 * 0.03 * frac_layer
    assert p.compute_s == pytest.approx(expected)


def test_weighted_tp_gives_the_faster_node_the_larger_share():
    assert layer_shares(CFG, 2, (2.0, 1.0))[0] > layer_shares(CFG, 2, (1.0, 1.0))[0]
    nodes = [NodeSpec("fast", 0.01), NodeSpec("slow", 0.02)]
    equal = predict(CFG, Layout(tp=2), nodes, FREE)
    weighted = predict(CFG, Layout(tp=2, weighted=True), nodes, FREE)
    assert weighted.compute_s < equal.compute_s


def test_allreduce_is_free_on_one_rank_and_grows_with_ranks():
    assert allreduce_s(LINK, 1, S) == 0
    assert allreduce_s(LINK, 3, S) == pytest.approx(2 * LINK.message_s(S))
    big = 1 << 20  # above the small-tensor limit: reduce-scatter + all-gather of N chunks
    assert allreduce_s(LINK, 3, big) == pytest.approx(4 * LINK.message_s(big / 3))


def test_plan_picks_one_node_over_a_slow_link_and_tp_over_a_fast_one():
    nodes = [NodeSpec("a", 0.01), NodeSpec("b", 0.01)]
    slow = LinkSpec(rtt_s=1e-3, goodput_bytes_per_s=1e6)
    assert rank_layouts(CFG, nodes, slow)[0].layout == Layout()
    assert rank_layouts(CFG, nodes, FREE)[0].layout.tp == 2


def test_layouts_the_code_cannot_build_are_left_out():
    nodes = [NodeSpec(f"n{i}", 0.01) for i in range(5)]
    layouts = {p.layout for p in rank_layouts(CFG, nodes, LINK)}
    assert Layout(pp=4) in layouts and Layout(pp=5) not in layouts  # 4 layers: at most 4 stages


def test_candidates_cover_every_grid_that_fits():
    names = {lay.name for lay in candidate_layouts(4)}
    assert {"single", "TP=2", "PP=2", "TP=3", "PP=3", "TP=2xPP=2", "TP=4 weighted"} <= names
    assert "TP=2xPP=3" not in names


def test_too_few_nodes_is_a_plan_model_error():
    with pytest.raises(PlanModelError, match="needs 2 nodes"):
        predict(CFG, Layout(tp=2), [NodeSpec("a", 0.01)], LINK)


@pytest.mark.parametrize(
    "text, seconds", [("6ms", 0.006), ("80us", 80e-6), ("0.5s", 0.5), ("200tok/s", 0.005)]
)
def test_durations_parse(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_rates_parse_with_tcp_efficiency_for_line_rates():
    assert parse_rate("280MB/s") == pytest.approx(280e6)
    assert parse_rate("2.5gbit") == pytest.approx(2.5e9 / 8 * 0.94)


def test_nodes_parse_with_optional_host():
    assert parse_node("gpu:6ms") == NodeSpec("gpu", 0.006)
    assert parse_node("c:1s@box") == NodeSpec("c", 1.0, host="box")


@pytest.mark.parametrize("bad", ["gpu", ":6ms", "gpu:fast", "gpu:-1ms", "gpu:0ms"])
def test_bad_node_text_is_a_plan_model_error(bad):
    with pytest.raises(PlanModelError):
        parse_node(bad)


def test_bad_rate_is_a_plan_model_error():
    with pytest.raises(PlanModelError):
        parse_rate("fast")


def test_plan_puts_the_fastest_node_first_so_single_means_the_best_node_alone():
    nodes = [NodeSpec("cpu", 0.2), NodeSpec("gpu", 0.006)]
    preds = {p.layout.name: p for p in rank_layouts(CFG, nodes, LINK)}
    assert preds["single"].s_per_token == pytest.approx(0.006)


def test_a_host_with_two_slots_runs_two_ranks_at_full_speed_and_shares_beyond():
    two = [NodeSpec(f"r{i}", 0.01, host="box", slots=2) for i in range(3)]
    assert predict(CFG, Layout(tp=2), two, FREE).compute_s == pytest.approx(0.005)
    # three ranks on two slots: each has a third of the work, the host does all of it at 2x
    tp3 = predict(CFG, Layout(tp=3), two, FREE).compute_s
    assert tp3 == pytest.approx(0.005, rel=0.1) and tp3 > 0.01 / 3
    # pipeline stages take turns, whatever the slots
    assert predict(CFG, Layout(pp=2), two, FREE).compute_s == pytest.approx(0.01)
    with pytest.raises(PlanModelError):
        NodeSpec("x", 0.01, slots=0)


def test_a_moe_ranks_share_of_a_layer_is_what_it_reads_per_token():
    """Qwen3-30B-A3B's shape at TP=2, expert rows 384 / 384: a rank reads its attention
    2048 128 (2 16 + 2 2) = 9 437 184, the whole router 128 2048 = 262 144 and its rows of the 8
    chosen experts 8 3 2048 384 = 18 874 368, of a layer's 56 885 248 read (the 128 experts it
    holds do not enter): 0.5023 each, where the dense formula (an MLP of 6144) gave 0.5."""
    from tandem.config import ModelConfig
    from tandem.moe_config import MoESpec

    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, qk_norm=True,
        moe=MoESpec(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True),
    )  # fmt: skip
    share = (9_437_184 + 262_144 + 18_874_368) / 56_885_248
    assert layer_shares(config, 2, None) == pytest.approx((share, share), rel=1e-12)
