import subprocess
import sys


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
