"""A fault drill against a running `tandem launch` / `tandem serve`: N concurrent streaming greedy
completions, a signal to one worker process (or another fault: a blackholed link) once every
stream is under way, and the timeline of what the server said meanwhile (for
`scripts/bench/recovery.py` and the e2e recovery tests).

    t_fault      the signal was sent (monotonic seconds; every figure below is relative to it)
    detect_s     /health first answered 503
    whole_s      /health answered 200 again (the group re-formed)
    resume_s     the first text of any stream after /health said 503 (the replay's first token)
    done_s       every stream finished
    pauses       per stream, its longest silence across the fault (the gap between two chunks, the
                 later one after the signal)

`pause_bound` is how long the fault may silence a stream: the heartbeat's detection bound (the
heartbeat timeout and one beat interval, or the 503 as measured if later), the re-form this drill
measured (from the first 503 to the next 200), and, from an uninterrupted run under the same load,
what a replay costs before its first new token (the longest time to first text: a prefill of the
batch) and two steps (the one in flight when the fault came, the replay's first decode), plus the
/health poll interval twice.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from tandem.transport.heartbeat import BEATS_PER_TIMEOUT


@dataclass
class StreamResult:
    """One streamed completion: its text, its chunks' arrival times, how it finished."""

    text: str = ""
    times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False


@dataclass
class DrillResult:
    streams: list[StreamResult]
    health: list[tuple[float, int, str]]  # (t - t_fault, status, detail)
    t_start: float = 0.0  # the requests were sent
    victim_pid: int | None = None
    t_fault: float | None = None
    in_flight_at_fault: int = 0

    def first(self, status: int, after: float = 0.0) -> float | None:
        for t, code, _ in self.health:
            if code == status and t >= after:
                return t
        return None

    @property
    def ttft_s(self) -> float | None:
        """From the requests to the first text of any stream."""
        firsts = [s.times[0] - self.t_start for s in self.streams if s.times]
        return min(firsts) if firsts else None

    @property
    def detect_s(self) -> float | None:
        return self.first(503)

    @property
    def whole_s(self) -> float | None:
        d = self.detect_s
        return None if d is None else self.first(200, after=d)

    @property
    def resume_s(self) -> float | None:
        d = self.detect_s
        if self.t_fault is None or d is None:
            return None
        after = [t - self.t_fault for s in self.streams for t in s.times if t > self.t_fault + d]
        return min(after) if after else None

    @property
    def pauses(self) -> list[float]:
        """Each stream's longest gap between two chunks whose later one came after the fault
        (0.0 for a stream that had finished by then)."""
        if self.t_fault is None:
            return []
        return [
            max((b - a for a, b in zip(s.times, s.times[1:]) if b > self.t_fault), default=0.0)
            for s in self.streams
        ]

    @property
    def longest_gap_s(self) -> float:
        """The longest gap between two chunks of any stream (of a run without a fault: a step
        under this load, at its slowest)."""
        gaps = [b - a for s in self.streams for a, b in zip(s.times, s.times[1:])]
        return max(gaps, default=0.0)

    @property
    def slowest_first_s(self) -> float | None:
        """From the requests to the first text of the last stream to get one (the batch's
        prefill)."""
        firsts = [s.times[0] - self.t_start for s in self.streams if s.times]
        return max(firsts) if firsts else None

    @property
    def done_s(self) -> float | None:
        ends = [s.times[-1] - self.t_fault for s in self.streams if s.times and self.t_fault]
        return max(ends) if ends else None


def pause_bound(
    drill: DrillResult, quiet: DrillResult, heartbeat_timeout: float, poll_s: float = 0.05
) -> float:
    """The longest a stream of `drill` may be silent: the detection, heartbeat timeout x (1 + 1 /
    beats per timeout) (a hung peer is declared lost within that of its last beat; the measured
    503 where a loaded machine saw it later, which a caller bounds on its own) + the measured
    re-form (`whole_s - detect_s`) + `quiet`'s slowest first text (the replay's prefill) + 2 x
    `quiet`'s longest gap (the step in flight at the fault, the replay's first decode) + 2 poll
    intervals (the 503 and the 200 are each seen up to one poll late). Needs a drill that saw
    both the 503 and the 200."""
    if drill.detect_s is None or drill.whole_s is None or quiet.slowest_first_s is None:
        raise ValueError("the drill saw no 503 and 200, or the quiet run no text")
    detect = max(heartbeat_timeout * (1 + 1 / BEATS_PER_TIMEOUT), drill.detect_s)
    reform = drill.whole_s - drill.detect_s
    return detect + reform + quiet.slowest_first_s + 2 * quiet.longest_gap_s + 2 * poll_s


def health(base: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            return r.status, json.loads(r.read() or b"{}").get("detail", "")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}").get("detail", "")
        except ValueError:
            return e.code, ""
    except (OSError, ValueError):
        return 0, ""


def served_model(base: str) -> str:
    """The model id the server answers to (GET /v1/models)."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def stream_completion(
    base: str,
    prompt: str,
    max_tokens: int,
    out: StreamResult,
    timeout_s: float = 300.0,
    model: str = "model",
) -> None:
    """POST /v1/completions (greedy, streamed, EOS ignored), filling `out` as chunks arrive."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"].get("message"))
                    continue
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        out.text += choice["text"]
                        out.times.append(time.monotonic())
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
    except (OSError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.done = True


def worker_pids(server_pid: int) -> list[int]:
    """The `tandem worker` / `tandem stage` processes below `server_pid`."""
    try:
        kids = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            argv = k.cmdline()
        except psutil.Error:
            continue
        if "tandem" in argv and ("worker" in argv or "stage" in argv):
            out.append(k.pid)
    return out


def run_drill(
    base: str,
    server_pid: int,
    prompts: list[str],
    *,
    max_tokens: int,
    sig: int | None = signal.SIGKILL,
    after_chunks: int = 4,
    timeout_s: float = 300.0,
    poll_s: float = 0.05,
    fault: Callable[[int], object] | None = None,
) -> DrillResult:
    """Streams `prompts` at once; when every stream has `after_chunks` chunks, sends `sig` to the
    first worker below `server_pid` (None: no fault, the uninterrupted run), or calls `fault`
    with that worker's pid instead (a fault that is no signal: a blackholed link); returns when
    every stream has finished (or `timeout_s`)."""
    streams = [StreamResult() for _ in prompts]
    model = served_model(base)
    threads = [
        threading.Thread(
            target=stream_completion, args=(base, p, max_tokens, s, timeout_s, model), daemon=True
        )
        for p, s in zip(prompts, streams)
    ]
    t_start = time.monotonic()
    for th in threads:
        th.start()
    res = DrillResult(streams, [], t_start)
    deadline = time.monotonic() + timeout_s
    armed = sig is not None or fault is not None
    while armed and res.t_fault is None and time.monotonic() < deadline:
        if all(len(s.times) >= after_chunks or s.done for s in streams):
            victims = worker_pids(server_pid)
            if not victims:
                break
            res.victim_pid = victims[0]
            res.in_flight_at_fault = sum(not s.done for s in streams)
            res.t_fault = time.monotonic()
            if fault is not None:
                fault(res.victim_pid)
            else:
                os.kill(res.victim_pid, sig)
        time.sleep(0.01)
    t0 = res.t_fault or time.monotonic()
    while any(th.is_alive() for th in threads) and time.monotonic() < deadline:
        code, detail = health(base)
        res.health.append((time.monotonic() - t0, code, detail))
        time.sleep(poll_s)
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    code, detail = health(base)
    res.health.append((time.monotonic() - t0, code, detail))
    return res
