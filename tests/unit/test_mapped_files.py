"""A model file truncated or replaced under a process that maps it: every step checks the file's
identity first (a typed error naming the file, `/health` saying so, no SIGBUS), and a SIGBUS
that lands anyway (a truncation inside a step) is named by its file and ends the process with
`MAPPED_FILE_EXIT`, which the supervisor names."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from tandem.cluster.exits import MAPPED_FILE_EXIT, exit_cause
from tandem.engine.build import Layout, Limits, build_executor
from tandem.engine.executor import Step, StepSequence
from tandem.engine.lean import LeanExecutor
from tandem.kernels import library
from tandem.loaders.errors import ModelFileChangedError
from tandem.loaders.file_identity import ModelFiles
from tandem.loaders.gguf.writer import write_preset_gguf


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    _, (f,) = write_preset_gguf(tmp_path_factory.mktemp("g") / "m.gguf", "tiny-qwen3", "Q8_0")
    return f


@pytest.fixture
def gguf(made, tmp_path):
    """A copy of the file this test may truncate."""
    return shutil.copy(made, tmp_path / "m.gguf")


def test_a_files_identity_names_truncation_replacement_rewrite_and_removal(tmp_path):
    for how, change, said in [
        ("truncated", lambda p: os.truncate(p, 10), r"truncated to 10 bytes \(it had 100\)"),
        ("replaced", lambda p: os.replace(_beside(p), p), "replaced by another file"),
        ("rewritten", lambda p: os.utime(p, ns=(0, 0)), "rewritten in place"),
        ("removed", lambda p: p.unlink(), "gone"),
    ]:
        p = tmp_path / f"{how}.bin"
        p.write_bytes(b"x" * 100)
        files = ModelFiles([p])
        files.check()
        change(p)
        with pytest.raises(ModelFileChangedError, match=said) as e:
            files.check()
        assert str(p) in str(e.value)
        if p.exists() and how == "truncated":
            p.write_bytes(b"x" * 100)  # put back: the mapping is not whole again, still refused
            assert files.change() is not None


def _beside(p):
    """A new file of the same size next to `p` (another inode while both exist)."""
    q = p.with_suffix(".new")
    q.write_bytes(b"z" * 100)
    return q


def _step(seq: int, start: int, ids: list[int]) -> Step:
    return Step(sequences=[StepSequence(seq, tuple(ids), start)], greedy=True)


@pytest.mark.parametrize("path", ["lean", "torch"])
def test_a_step_after_the_file_was_truncated_is_refused_by_name_without_a_sigbus(gguf, path):
    if path == "lean":
        ex = LeanExecutor.from_file(gguf, max_batch=1, max_seq_len=64)
    else:
        ex = build_executor(gguf, Layout(), Limits(1, 64))
    ex.run(_step(0, 0, [1, 2, 3]))
    assert ex.health() == (True, "ok")
    os.truncate(gguf, 4096)  # every tensor's bytes are past the end now
    with pytest.raises(ModelFileChangedError, match=r"m\.gguf changed .* truncated to 4096"):
        ex.run(_step(0, 3, [4]))
    ok, detail = ex.health()
    assert not ok and "truncated to 4096 bytes" in detail and str(gguf) in detail


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.skipif(not library.available(), reason=f"no native build: {library.why()}")
def test_a_sigbus_on_a_mapped_model_file_is_named_and_ends_the_process_with_its_code(gguf):
    """The truncation that lands inside a step: the read past the new end is a SIGBUS."""
    r = _child(
        """
        import os, sys
        from tandem.kernels import mapped_guard
        from tandem.loaders.gguf.model_file import GGUFModel
        src = GGUFModel(sys.argv[1])
        assert mapped_guard.watch(src)
        os.truncate(sys.argv[1], 4096)
        print(int(src.readers[0].data[-1]))  # a page past the new end
        """,
        str(gguf),
    )
    assert r.returncode == MAPPED_FILE_EXIT, r.stderr
    assert f"SIGBUS reading the mapped model file {gguf} at byte" in r.stderr
    assert "truncated or replaced" in exit_cause(r.returncode)


def test_a_sigbus_on_any_other_mapping_still_gets_a_traceback(gguf, tmp_path):
    other = tmp_path / "other.bin"
    other.write_bytes(b"y" * 65536)
    r = _child(
        """
        import mmap, os, sys
        from tandem.kernels import mapped_guard
        from tandem.loaders.gguf.model_file import GGUFModel
        mapped_guard.watch(GGUFModel(sys.argv[1]))
        f = open(sys.argv[2], "rb")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate(sys.argv[2], 0)
        print(m[65535])
        """,
        str(gguf),
        str(other),
    )
    assert r.returncode == -signal.SIGBUS, r.stderr
    assert "Fatal Python error: Bus error" in r.stderr
    assert "SIGBUS: a mapped file" in exit_cause(r.returncode)
