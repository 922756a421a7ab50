import subprocess
import sys

import pytest


def test_cli_help_lists_usage():
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "usage: tandem" in out.stdout


def test_the_prefix_cache_is_on_by_default_and_launch_passes_its_flag_to_serve():
    from pathlib import Path

    from tandem.cli.launch import serve_argv
    from tandem.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).prefix_cache is True
    assert parser.parse_args(["serve", "--no-prefix-cache"]).prefix_cache is False
    on = parser.parse_args(["launch"])
    off = parser.parse_args(["launch", "--no-prefix-cache"])
    assert "--no-prefix-cache" not in serve_argv(on, Path("m.gguf"))
    assert serve_argv(off, Path("m.gguf"))[-1] == "--no-prefix-cache"
    served = parser.parse_args(serve_argv(off, Path("m.gguf"))[3:])
    assert served.prefix_cache is False


def test_a_joined_head_serves_with_the_reasoning_parser_and_reform_timeout_it_was_given():
    """`cluster join --reasoning-parser` reaches the head's `tandem serve` as `serve` takes it, and
    serve, launch and cluster join share one default re-form timeout."""
    from pathlib import Path

    from tandem.cli.cluster import rank_argv
    from tandem.cli.main import build_parser
    from tandem.cli.serve import DEFAULT_REFORM_TIMEOUT_S, REASONING_PARSERS

    parser = build_parser()
    for cmd in (["serve"], ["launch"], ["cluster", "join", "TOKEN"]):
        args = parser.parse_args(cmd)
        assert args.reform_timeout == DEFAULT_REFORM_TIMEOUT_S
        assert args.reasoning_parser == "auto"
    for choice in REASONING_PARSERS:
        join = parser.parse_args(
            ["cluster", "join", "TOKEN", "--model", "m", "--reasoning-parser", choice]
        )
        head = parser.parse_args(rank_argv(join, 0, Path("ring0.json"))[3:])
        assert head.command == "serve" and head.reasoning_parser == choice
        assert head.reform_timeout == DEFAULT_REFORM_TIMEOUT_S
        worker = rank_argv(join, 1, Path("ring1.json"), epoch=2)
        assert worker[3] == "worker" and "--reasoning-parser" not in worker
    with pytest.raises(SystemExit) as e:  # an unknown parser is refused, as serve refuses it
        parser.parse_args(["cluster", "join", "TOKEN", "--reasoning-parser", "guess"])
    assert e.value.code == 2


def test_a_joined_head_serves_with_the_allowed_hosts_it_was_given():
    """`cluster join --allowed-hosts` reaches the head's `tandem serve` (its Host allow-list);
    without it the head takes serve's default, and a worker never gets it."""
    from pathlib import Path

    from tandem.cli.cluster import rank_argv
    from tandem.cli.main import build_parser

    parser = build_parser()
    join = parser.parse_args(
        ["cluster", "join", "TOKEN", "--model", "m", "--allowed-hosts", "llm.lan,box.local"]
    )
    head = parser.parse_args(rank_argv(join, 0, Path("ring0.json"))[3:])
    assert head.command == "serve" and head.allowed_hosts == "llm.lan,box.local"
    assert "--allowed-hosts" not in rank_argv(join, 1, Path("ring1.json"))
    plain = parser.parse_args(["cluster", "join", "TOKEN", "--model", "m"])
    head = parser.parse_args(rank_argv(plain, 0, Path("ring0.json"))[3:])
    assert head.allowed_hosts == parser.parse_args(["serve"]).allowed_hosts


def test_cache_mem_takes_byte_counts_and_launch_passes_it_to_serve():
    from pathlib import Path

    from tandem.cli.launch import serve_argv
    from tandem.cli.main import build_parser
    from tandem.cli.serve import parse_bytes

    assert [parse_bytes(t) for t in ("1048576", "512M", "2G", "3KiB", "1gb")] == [
        1 << 20, 512 << 20, 2 << 30, 3 << 10, 1 << 30,
    ]  # fmt: skip
    for bad in ("", "M", "1.5G", "-3", "2T"):
        with pytest.raises(Exception, match="byte count"):
            parse_bytes(bad)
    parser = build_parser()
    assert parser.parse_args(["serve"]).cache_mem is None
    args = parser.parse_args(["launch", "--cache-mem", "64M"])
    served = parser.parse_args(serve_argv(args, Path("m.gguf"))[3:])
    assert served.cache_mem == 64 << 20


def test_cache_mem_counts_the_kv_blocks_of_the_executors_dtype():
    from tandem.cli.engine_factory import cache_block
    from tandem.models.presets import get_preset
    from tandem.parallel.fit import sequence_cache_bytes

    cfg = get_preset("tiny-qwen3").config

    class Ex:  # what cache_block reads of an executor
        def __init__(self, *dtypes):
            self.dtypes = dtypes

        def describe(self):
            return {"ranks": [{"dtype": d} for d in self.dtypes]}

    f32, bf16 = cache_block(Ex("float32"), cfg), cache_block(Ex("bfloat16"), cfg)
    assert f32.tokens * cfg.head_dim * 4 % 4096 == 0  # a block is whole pages of one head
    assert bf16.tokens == 2 * f32.tokens  # the same page, half the bytes a position
    assert f32.bytes == sequence_cache_bytes(cfg, f32.tokens, 4)["kv"] == bf16.bytes
    assert f32.entry_bytes == 0  # no recurrent layer
    # a float32 head beside a bf16 rank: the bf16 rank's longer blocks at float32's bytes, so
    # a block counted shared is shared on both and the count bounds what they hold
    mixed = cache_block(Ex("float32", "bfloat16"), cfg)
    assert mixed == cache_block(Ex("bfloat16", "float32"), cfg)
    assert mixed.tokens == bf16.tokens
    assert mixed.bytes == sequence_cache_bytes(cfg, bf16.tokens, 4)["kv"] == 2 * f32.bytes
