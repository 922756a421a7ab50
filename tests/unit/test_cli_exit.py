"""A long-lived command run from the command line ends with `os._exit` (`tandem.cli.exit_now`):
its exit code, its logs and its buffered output survive that; `main(argv)` from Python returns."""

import os
import subprocess
import sys

import pytest

from tandem.cli.main import COMMAND_MODULES, LONG_LIVED


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RING_CONFIG"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, **kw)


def test_exit_now_flushes_the_logs_and_the_piped_stdout_and_keeps_the_code(tmp_path) -> None:
    log = tmp_path / "run.log"
    done = _run(
        [
            sys.executable,
            "-c",
            "import logging, sys\n"
            "from tandem.cli.exit_now import exit_now\n"
            f"logging.basicConfig(filename={str(log)!r})\n"
            "logging.warning('last words')\n"
            "print('buffered', end='')\n"  # stdout to a pipe: block-buffered, not yet written
            "sys.stderr.write('err')\n"
            "exit_now(3)\n"
            "print('not reached')",
        ]
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "buffered", "err")
    assert "last words" in log.read_text()


def test_a_long_lived_commands_error_code_and_message_survive_the_fast_exit(tmp_path) -> None:
    """serve's typed error returns 2 (one line); the worker's uncaught error exits 1 with the
    traceback Python prints."""
    serve = _run([sys.executable, "-m", "tandem", "serve", "--model", str(tmp_path / "none")])
    assert serve.returncode == 2
    assert "tandem serve: error:" in serve.stderr and "not a model directory" in serve.stderr
    worker = _run([sys.executable, "-m", "tandem", "worker", "--model", str(tmp_path)])
    assert worker.returncode == 1
    assert "Traceback" in worker.stderr and "WorkerArgsError" in worker.stderr


def test_main_called_from_python_returns_instead_of_exiting(tmp_path) -> None:
    from tandem.cli.main import main
    from tandem.cli.worker import WorkerArgsError

    assert main(["serve", "--model", str(tmp_path / "none")]) == 2
    with pytest.raises(WorkerArgsError):
        main(["worker", "--model", str(tmp_path)])


def test_the_long_lived_commands_are_commands() -> None:
    assert LONG_LIVED <= set(COMMAND_MODULES)
