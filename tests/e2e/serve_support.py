"""Starting a real `tandem serve` / `tandem launch` process for the e2e tests, and cleaning it up."""

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from tandem.bench.fault_drill import pause_bound
from tandem.cluster.exits import PEER_LOST_EXIT
from tandem.cluster.launcher import free_ports

TANDEM = [sys.executable, "-m", "tandem"]
PRESET = "tiny-qwen3"


_MADE: dict[tuple[str, int], Path] = {}  # (preset, seed) -> the directory `make-model` wrote


def make_model(out: Path, preset: str = PRESET, seed: int = 0) -> Path:
    """`tandem make-model OUT --preset P --seed S`, run once per (preset, seed) in the test session
    (a process start and a model write) and copied to each later `out`: the same bytes, since
    make-model is deterministic in its seed, in a directory the calling test owns."""
    made = _MADE.get((preset, seed))
    if made is None:
        made = Path(tempfile.mkdtemp(prefix="tandem-made-")) / f"{preset}-{seed}"
        atexit.register(shutil.rmtree, made.parent, True)
        r = subprocess.run(
            [*TANDEM, "make-model", str(made), "--preset", preset, "--seed", str(seed)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        _MADE[(preset, seed)] = made
    shutil.copytree(made, out)
    return out


def health(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def spawn(argv: list[str], env: dict | None = None, preexec_fn=None) -> subprocess.Popen:
    """Starts `argv` with its output (and its children's) in a temporary file, never an unread
    pipe: a pipe nobody drains fills at 64 KB and then blocks whichever process writes next."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=preexec_fn
    )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def output(proc: subprocess.Popen) -> str:
    """Everything `proc` (started by `spawn`, or with a pipe) has written so far."""
    log = getattr(proc, "log", None)
    if log is None:
        return proc.stdout.read() if proc.stdout else ""
    log.flush()
    log.seek(0)
    return log.read()


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 180.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            out = output(proc)
            raise AssertionError(f"server exited with {proc.returncode}: {out[-3000:]}")
        if health(base) == 200:
            return
        time.sleep(0.3)
    raise AssertionError("server did not become healthy")


def descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).children(recursive=True)
    return []


def kill_tree(proc: subprocess.Popen) -> None:
    kill_trees([proc])


def kill_trees(roots: list[subprocess.Popen]) -> None:
    """SIGKILLs every process of every tree first, then waits for them all (not tree by tree)."""
    procs = []
    for proc in roots:
        procs += descendants(proc.pid)
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(proc.pid))
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)
    for proc in roots:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


@contextlib.contextmanager
def running(args: list[str], env: dict | None = None):
    """Starts `tandem <args> --port P`, waits for /health 200, yields (proc, base URL)."""
    (port,) = free_ports(1)
    proc = spawn([*TANDEM, *args, "--port", str(port)], env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        yield proc, base
    finally:
        kill_tree(proc)


@contextlib.contextmanager
def running_all(*argss: list[str]):
    """Starts `tandem <args> --port P` for each `args` at once, waits for every /health 200,
    yields [(proc, base URL), ...] in the order given. The servers' start-ups (imports, model
    loads) overlap instead of following one another; each is the process `running` starts."""
    ports = free_ports(len(argss))
    procs = [
        spawn([*TANDEM, *args, "--port", str(p)]) for args, p in zip(argss, ports, strict=True)
    ]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for proc, base in zip(procs, bases, strict=True):
            wait_healthy(proc, base)
        yield list(zip(procs, bases, strict=True))
    finally:
        kill_trees(procs)


@contextlib.contextmanager
def relay_for_links(ranks: str, tcp_ring: bool = True):
    """A `tcp_proxy.Relay` (tests/distributed) and the environment that routes the links of
    `ranks` ("A" or "A-B", `tandem.transport.relay_seam`) through it, with same-host pairs kept
    on TCP (TANDEM_SHM=0) so the ring's data crosses the relay too (`tcp_ring=False`: the rings
    keep shared memory, for a cut of pipeline links only); yields (relay, env)."""
    distributed = str(Path(__file__).parents[1] / "distributed")
    if distributed not in sys.path:
        sys.path.append(distributed)
    from tcp_proxy import Relay

    from tandem.transport.relay_seam import ENV

    relay = Relay()
    try:
        yield relay, {ENV: relay.route(ranks), **({"TANDEM_SHM": "0"} if tcp_ring else {})}
    finally:
        relay.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise KeyError(name)


def complete(base: str, prompt: str = "Once upon a time", max_tokens: int = 12) -> str:
    """One greedy `/v1/completions` text (EOS ignored, so its length is fixed)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    req = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


# scheduling on a loaded 2-core runner beyond the measured parts of the bound; the claim is a pause
# of the detection and the re-form, far below the op timeout a hang used to cost
PAUSE_SLACK_S = 3.0


def assert_paused_within_bound(drill, quiet, heartbeat_s: float, op_timeout_s: float) -> None:
    """Each stream's longest silence across the fault fits the detection, the re-form this drill
    measured and a replay (`fault_drill.pause_bound`), plus PAUSE_SLACK_S, below the op timeout."""
    bound = pause_bound(drill, quiet, heartbeat_s)
    print(f"pauses {[round(p, 2) for p in drill.pauses]} s, bound {bound:.2f} s (503 at "
          f"{drill.detect_s:.2f} s, 200 at {drill.whole_s:.2f} s)")  # fmt: skip
    assert 0 < max(drill.pauses) <= bound + PAUSE_SLACK_S < op_timeout_s, (
        drill.pauses,
        bound,
        drill.detect_s,
        drill.whole_s,
    )


def lost_by_a_heartbeat(reasons, rank: int, where: str, peer: str = "") -> bool:
    """Both ends of a cut link go silent at once: the head's heartbeat loses `rank`, or a rank's
    own heartbeat loses its peer first and it exits with PEER_LOST_EXIT, which the head names
    (/health's 200 characters may cut the word after "heartbeat"); in a grid, `peer`: the lost
    rank's TP peer, whose socket to it closed when it exited so, failed its stage first, naming
    the lost rank's place ("stage 1 (TP rank 0): PeerClosedError: rank 1 (")."""
    by_head = any(f"rank {rank} is lost" in r and "heartbeat" in r and where in r for r in reasons)
    by_rank = any(f"code {PEER_LOST_EXIT} (its heartbeat" in r for r in reasons)
    by_peer = bool(peer) and any(peer in r for r in reasons)
    return by_head or by_rank or by_peer
