import subprocess
import sys


def test_cli_help_lists_usage():
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "usage: tandem" in out.stdout
