"""`tandem plan` end to end on a config.json: a table, a pick, JSON, and typed refusals."""

import argparse
import json

import pytest

from tandem.cli import plan

HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "tie_word_embeddings": True, "hidden_act": "silu",
}  # fmt: skip


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    plan.register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr()


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    return str(tmp_path)


def test_plan_for_two_paper_nodes_over_2_5gbe_prints_every_layout_and_a_pick(model_dir, capsys):
    rc, out = _run(["--model", model_dir, "--node", "spark:168tok/s", "--node", "evo:168tok/s",
                    "--link", "2.5gbit"], capsys)  # fmt: skip
    assert rc == 0
    assert "| single |" in out.out and "| TP=2 |" in out.out and "| PP=2 |" in out.out
    assert "pick: " in out.out


def test_plan_json_predictions_are_sorted_fastest_first(model_dir, capsys):
    rc, out = _run(["--model", model_dir, "--node", "a:6ms", "--node", "b:6ms", "--node", "c:6ms",
                    "--json"], capsys)  # fmt: skip
    doc = json.loads(out.out)
    speeds = [p["tok_per_s"] for p in doc["predictions"]]
    assert rc == 0 and speeds == sorted(speeds, reverse=True)
    assert doc["pick"] == doc["predictions"][0]["layout"]
    assert {"TP=3", "PP=3"} <= {p["layout"] for p in doc["predictions"]}


def test_plan_without_nodes_is_refused_with_a_message(model_dir, capsys):
    rc, out = _run(["--model", model_dir], capsys)
    assert rc == 2 and "--node" in out.err


def test_plan_with_an_unreadable_model_dir_is_refused(tmp_path, capsys):
    rc, out = _run(["--model", str(tmp_path), "--node", "a:6ms"], capsys)
    assert rc == 2 and "config" in out.err


def test_plan_on_a_k_quant_gguf_shows_block_rounded_shards_and_names_the_o_proj_fallback(
    tmp_path, capsys
):
    from dataclasses import replace

    from tandem.loaders.gguf.writer import write_preset_gguf
    from tandem.models.presets import get_preset

    # 8 q heads of 96: TP=2 cuts o_proj's contraction at 384, not a multiple of Q5_K's 256
    shape = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=96,
                 intermediate_size=768, vocab_size=512, num_hidden_layers=2)  # fmt: skip
    config = replace(get_preset("tiny-qwen3-untied").config, **shape)
    _, (f,) = write_preset_gguf(tmp_path / "k.gguf", "tiny-qwen3-untied", "K_MIX", config=config)
    rc, out = _run(["--model", str(f), "--node", "a:50ms", "--node", "b:50ms", "--max-pp", "1"],
                   capsys)  # fmt: skip
    assert rc == 0, out.err
    assert (
        "o_proj contraction in blocks of 256, down_proj of 256; MLP rows in blocks of 256"
        in out.out
    )
    assert "fallback 'gather'" in out.out
    assert (
        "rank 0: kv heads [0, 1) q heads [0, 4) o_proj cols [0, 512) mlp rows [0, 512)" in out.out
    )
    assert (
        "rank 1: kv heads [1, 2) q heads [4, 8) o_proj cols [512, 768) mlp rows [512, 768)"
        in out.out
    )


def test_plan_shows_each_ranks_experts_and_the_expert_bytes_it_reads_per_token(tmp_path, capsys):
    """tiny-qwen3-moe in float32 (8 experts of 64 rows, 2 active, D 64, layers 0 and 2 sparse,
    layer 1 dense with MLP 128): under rows each rank reads 2 experts x 32 rows x 3 x 64 x 4 bytes
    x 2 sparse layers = 98 304 B of experts per token; under whole experts 2 x 4 / 8 = 1 expert x
    64 rows, the same 0.10 MB expected, and it holds 4 x 64 x 3 x 64 x 4 x 2 = 0.39 MB of them.
    The JSON carries the same placement."""
    from tandem.loaders.make import make_model_dir

    make_model_dir(tmp_path / "moe", "tiny-qwen3-moe")
    nodes = ["--node", "a:50ms", "--node", "b:50ms", "--model", str(tmp_path / "moe")]
    out = _run(nodes, capsys)[1].out
    assert "pick: TP=2" in out
    assert "experts: 8, 2 active per token; placed as rows of every expert" in out
    assert "rank 1 (b): experts [0, 8) rows [32, 64) (8 experts, 50 % of their rows)" in out
    assert "reads 0.23 MB/token: experts 0.10 (1.00 experts' worth)" in out
    out = _run([*nodes, "--moe", "experts"], capsys)[1].out
    assert "placed as whole experts" in out
    assert (
        "rank 1 (b): experts [4, 8) rows [0, 64) (4 experts, 100 % of their rows); holds 0.4 MB"
        in out
    )
    rc, js = _run([*nodes, "--moe", "experts", "--json"], capsys)
    ranks = json.loads(js.out)["experts"]["ranks"]
    assert [r["experts"] for r in ranks] == [[0, 4], [4, 8]]
    assert [r["active_bytes"]["experts"] for r in ranks] == [98_304, 98_304]
    assert [r["held_expert_bytes"] for r in ranks] == [393_216, 393_216]
    # a single node holds and reads them all; a preset is counted in bfloat16
    rc, js = _run(["--node", "a:50ms", "--preset", "tiny-qwen3-moe", "--json"], capsys)
    one = json.loads(js.out)["experts"]["ranks"]
    assert len(one) == 1 and one[0]["experts"] == [0, 8]
    assert one[0]["expert_groups"] == [{"experts": [0, 8], "rows": [0, 64]}]
    assert one[0]["active_bytes"]["experts"] == 2 * 64 * 3 * 64 * 2 * 2
