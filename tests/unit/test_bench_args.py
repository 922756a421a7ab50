"""The bench's small parsers: layouts and peer lists fail closed on bad text."""

import pytest

from tandem.bench.harness import BenchLayout, parse_layouts
from tandem.comm.peers import parse_peers


def test_layouts_parse_in_order():
    assert parse_layouts("single, tp2,PP3") == [
        BenchLayout("single"), BenchLayout("tp", 2), BenchLayout("pp", 3)
    ]  # fmt: skip
    assert [lay.name for lay in parse_layouts("tp2,pp2")] == ["TP=2", "PP=2"]


@pytest.mark.parametrize("bad", ["tp1", "tp", "dp2", "pp0", "single2"])
def test_bad_layouts_are_value_errors(bad):
    with pytest.raises(ValueError):
        parse_layouts(bad)


def test_peers_parse_to_host_port_pairs():
    assert parse_peers(["10.77.0.1:29610", "[::1]:5"]) == [("10.77.0.1", 29610), ("[::1]", 5)]


@pytest.mark.parametrize("bad", ["10.77.0.1", ":29610", "h:port"])
def test_bad_peers_are_value_errors(bad):
    with pytest.raises(ValueError):
        parse_peers([bad])


def test_bench_cli_refuses_an_unknown_link_before_starting_anything(tmp_path, capsys):
    from tandem.cli.main import main

    rc = main(["bench", "--model", str(tmp_path), "--links", "wifi", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--links" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--passes", "--rounds"])
def test_bench_cli_refuses_zero_passes_or_rounds_before_starting_anything(tmp_path, capsys, flag):
    from tandem.cli.main import main

    rc = main(["bench", "--model", str(tmp_path), flag, "0", "--out", str(tmp_path / "o")])
    assert rc == 2 and ">= 1" in capsys.readouterr().err


def test_the_best_pass_of_a_layout_is_its_fastest_and_keeps_every_pass():
    from tandem.bench.harness import best_pass

    runs = [{"layout": "TP=2", "decode_s_per_token": 0.2, "id": "a"},
            {"layout": "TP=2", "link": "loopback", "error": "worker died"},
            {"layout": "TP=2", "decode_s_per_token": 0.1, "id": "c"}]  # fmt: skip
    best = best_pass(runs)
    assert best["id"] == "c" and best["passes_decode_s_per_token"] == [0.2, None, 0.1]
    assert best_pass(runs[1:2]) == runs[1]  # every pass failed: the failure is the result


def test_bench_cli_refuses_a_path_that_is_no_model_before_starting_anything(tmp_path, capsys):
    from tandem.cli.main import main

    rc = main(["bench", "--model", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "none.gguf" in capsys.readouterr().err


def test_an_ep_layout_is_a_tp_group_holding_whole_experts():
    from tandem.bench.harness import BenchLayout, parse_layouts

    ep = parse_layouts("single,tp2,ep2")
    assert ep[2] == BenchLayout("tp", 2, "experts") and ep[2].name == "EP=2"
    assert ep[1].name == "TP=2" and ep[1].moe == "tp"
