"""`tandem bench`: one model, the controls and layouts side by side, on loopback and an emulated link.

For each link (loopback; an emulated 2.5 GbE switch, `netns.py`) and each layout (single, TP=N,
PP=M) the harness starts the ranks (`decode_run.py`) on their hosts, reads every host's byte
counters around the head's decode phase, and records TTFT, prefill and decode speed and wire bytes
per token. Then the peers in the same run: our ring against torch gloo all-reduce
(`collective_run.py`) on each link, and Hugging Face transformers decoding the same directory
(`hf_peer.py`; not for a GGUF file, which it would dequantize), and how much concurrent decodes
speed up. A GGUF model runs in its own blocks on every rank: TP shards cut on block boundaries and
PP stages holding their layers' blocks, each on the quantized kernels (`kernels.prepare`, "auto"),
as a single node's. Before each link's layouts, the lockstep probe (`lockstep.py`: k ranks on that
link's hosts, close in time to the TP runs it predicts; its layers random float32 ones).
Finally `plan_model` predicts every measured layout from the measured single-node speed and link
figures (the ring's per-message cost calibrated by the all-reduce run, never by the
layout runs), and `report.py` writes JSON, markdown and a PNG chart.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.bench.hosts import HostProcessFailed, Hosts, read_line
from tandem.bench.netns import (
    EmulatedNetwork,
    NetnsUnavailable,
    Shaping,
    check_available,
    stale_namespaces,
)
from tandem.devices import DTYPE_NAMES

BASE_PORT = 29610  # inside this run's private namespaces only; no other process binds there


@dataclass(frozen=True)
class BenchLayout:
    kind: str  # "single" | "tp" | "pp"
    n: int = 1
    moe: str = "tp"  # a TP group's expert placement: "experts" for an `epN` layout

    @property
    def name(self) -> str:
        if self.kind == "single":
            return "single"
        return f"EP={self.n}" if self.moe == "experts" else f"{self.kind.upper()}={self.n}"


def parse_layouts(text: str) -> list[BenchLayout]:
    """`"single,tp2,pp2,tp3,pp3,ep2"` -> layouts (`epN`: a TP group of N ranks holding an MoE's
    experts whole, `--moe experts`)."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part == "single":
            out.append(BenchLayout("single"))
        elif part[:2] in ("tp", "pp", "ep") and part[2:].isdigit() and int(part[2:]) >= 2:
            kind = "tp" if part[:2] == "ep" else part[:2]
            out.append(BenchLayout(kind, int(part[2:]), "experts" if part[:2] == "ep" else "tp"))
        else:
            raise ValueError(f"layout {part!r}: expected single, tpN, epN or ppN (N >= 2)")
    return out


def describe_model(path: str) -> tuple[object, dict]:
    """The model at `path` (a directory or FILE.gguf): its `ModelConfig` and the report's facts
    about it (path, weight format, bytes on disk)."""
    from tandem.loaders.gguf.model_file import gguf_files
    from tandem.loaders.source import is_gguf, open_model

    source = open_model(path)
    try:
        config, fmt = source.config, source.weight_format()
    finally:
        source.close()
    gguf = is_gguf(path)
    files = gguf_files(path) if gguf else sorted(Path(path).glob("*.safetensors"))
    return config, {"path": path, "gguf": gguf, "weight_format": fmt,
                    "file_bytes": sum(f.stat().st_size for f in files)}  # fmt: skip


@dataclass
class BenchOptions:
    model_dir: str  # a model directory or FILE.gguf
    layouts: list[BenchLayout] = field(default_factory=lambda: parse_layouts("single,tp2,pp2"))
    links: tuple[str, ...] = ("loopback", "emulated")
    rate_mbit: int = 2500
    prompt_len: int = 64
    decode: int = 32
    rounds: int = 2  # timed generations per process; the best is reported
    passes: int = 1  # processes per layout and link, interleaved over the layouts; the best kept
    dtype: str = "float32"
    threads: int = 2  # for the whole machine; split among co-located ranks
    collectives: bool = True
    probes: bool = True  # the lockstep probe and the concurrency measurement (TP predictions)
    hf_peer: bool = True
    timeout_s: float = 900.0
    log_dir: str | None = None


def machine_info() -> dict:
    import os
    import platform

    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "loadavg": load,
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__}  # fmt: skip


def _threads_per_rank(opts: BenchOptions, lay: BenchLayout) -> int:
    """TP ranks compute at once, so they split the machine's threads; pipeline stages take turns
    on one stream, so each gets them all (as each would on its own node)."""
    return max(1, opts.threads // lay.n) if lay.kind == "tp" else opts.threads


def _decode_argv(opts: BenchOptions, kind: str, threads: int) -> list[str]:
    """One `decode_run` process of layout `kind` with `threads` torch threads, timed as the run
    asks (prompt, decode tokens, rounds)."""
    return [sys.executable, "-m", "tandem.bench.decode_run", "--model", opts.model_dir,
            "--layout", kind, "--dtype", opts.dtype, "--threads", str(threads),
            "--prompt-len", str(opts.prompt_len), "--decode", str(opts.decode),
            "--rounds", str(opts.rounds),
            "--max-seq-len", str(opts.prompt_len + opts.decode + 16)]  # fmt: skip


def run_layout(
    hosts: Hosts, lay: BenchLayout, opts: BenchOptions, log: Callable[[str], None]
) -> dict:
    """Starts the layout's ranks (rank r on host r), gates the head's decode phase to read the
    byte counters, and returns the head's figures plus wire bytes per decode token."""
    n = lay.n
    secret = secrets.token_hex(16)
    peers = ",".join(f"{hosts.address(r)}:{BASE_PORT + r}" for r in range(n))
    base = _decode_argv(opts, lay.kind, _threads_per_rank(opts, lay))
    base += ["--world", str(n), "--peers", peers, "--secret", secret, "--moe", lay.moe]
    logs = _log_files(opts, f"{hosts.name.split()[0]}-{lay.name}", n)
    trace_dir = None
    if lay.kind == "tp" and opts.log_dir is not None:
        trace_dir = Path(opts.log_dir) / f"trace-{hosts.name.split()[0]}-{lay.name}"
        trace_dir.mkdir(parents=True, exist_ok=True)
        base += ["--trace-dir", str(trace_dir)]
    if lay.kind == "pp":  # the head starts the stages itself, each inside its host's namespace
        names = [hosts.namespace(r) for r in range(n)]
        if all(names):
            base += ["--netns", ",".join(names)]
    workers = [
        hosts.popen(r, [*base, "--rank", str(r)], stdout=logs[r], stderr=logs[r])
        for r in range(1, n)
        if lay.kind != "pp"
    ]
    head = hosts.popen(0, [*base, "--rank", "0", "--gate"], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=logs[0], text=True)  # fmt: skip
    marks: dict[str, list[int | None]] = {"decode_start": [], "decode_end": []}
    deadline = time.monotonic() + opts.timeout_s
    try:
        while True:
            line = read_line(head, timeout=max(1.0, deadline - time.monotonic()))
            if line.startswith("MARK "):
                marks[line.split()[1]].append(hosts.wire_bytes())
                head.stdin.write("\n")
                head.stdin.flush()
            elif line.startswith("{"):
                result = json.loads(line)
                break
            elif not line and head.poll() is not None:
                raise HostProcessFailed(f"{lay.name} head exited {head.returncode}")
        head.wait(timeout=60)
        for w in workers:
            w.wait(timeout=60)
        bad = [w.returncode for w in workers if w.returncode != 0]
        if head.returncode != 0 or bad:
            raise HostProcessFailed(f"{lay.name}: head {head.returncode}, workers {bad}")
    except HostProcessFailed as e:
        raise HostProcessFailed(f"{e} (logs: {opts.log_dir})") from None
    finally:
        for f in logs:
            f.close()
    spans = list(zip(marks["decode_start"], marks["decode_end"]))
    wire = None
    if spans and all(a is not None and b is not None for a, b in spans):
        wire = sum(b - a for a, b in spans) / (len(spans) * opts.decode)
    if trace_dir is not None:
        result["sync_in_place"] = _trace_sync(trace_dir, n, opts.decode)
    log(f"  {hosts.name:>24} {lay.name:>7}: {result['decode_tok_per_s']:.2f} tok/s decode, "
        f"TTFT {result['ttft_s']:.3f} s, wire {0 if wire is None else wire / 1e3:.1f} KB/token")  # fmt: skip
    return {**result, "layout": lay.name, "kind": lay.kind, "n": n, "link": hosts.name,
            "wire_bytes_per_token": wire}  # fmt: skip


def best_pass(runs: list[dict]) -> dict:
    """One layout's passes on one link -> its least disturbed one (the fastest decode; a failed
    pass only when all failed), with every pass's decode time kept as `passes_decode_s_per_token`
    (None for a failed pass)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    best = min(ok, key=lambda r: r["decode_s_per_token"])
    return {**best, "passes_decode_s_per_token": [r.get("decode_s_per_token") for r in runs]}


def measure_concurrency(opts: BenchOptions, k: int = 2) -> dict:
    """How much of a k-fold speed-up this machine gives k single-node decodes run at once (each
    with the threads a TP rank gets): `slots` = k t_alone / t_together, between 1 (they share
    everything) and k (independent). Memory-bound decode on one socket shares its bandwidth, so
    this is what co-located ranks can get, measured apart from any layout run."""
    argv = _decode_argv(opts, "single", max(1, opts.threads // k))

    def run(n: int) -> float:
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True) for _ in range(n)]  # fmt: skip
        outs = [p.communicate(timeout=opts.timeout_s)[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            raise HostProcessFailed("a concurrent single-node decode failed")
        times = [json.loads(o.strip().splitlines()[-1])["decode_s_per_token"] for o in outs]
        return sum(times) / len(times)

    alone, together = run(1), run(k)
    return {"k": k, "alone_s_per_token": alone, "together_s_per_token": together,
            "slots": min(float(k), max(1.0, k * alone / together))}  # fmt: skip


def _trace_sync(trace_dir: Path, n: int, decode: int) -> dict:
    """Synchronization and waiting per decode token from the ranks' collective traces."""
    from tandem.bench.optrace import analyze_traces

    traces = [json.loads((trace_dir / f"rank{r}.json").read_text()) for r in range(n)]
    rounds = [analyze_traces(traces, a, b) for a, b in traces[0]["marks"]["decode_spans"]]
    best = min(rounds, key=lambda r: r["sync_s"])
    return {"ms_per_token": best["sync_s"] / decode * 1e3,
            "skew_ms_per_token": best["skew_s"] / decode * 1e3,
            "collectives_per_token": best["collectives"] / decode,
            "by_kind": best["by_kind"],
            "rounds_ms_per_token": [r["sync_s"] / decode * 1e3 for r in rounds]}  # fmt: skip


def _log_files(opts: BenchOptions, tag: str, n: int) -> list:
    if opts.log_dir is None:
        return [open("/dev/null", "w") for _ in range(n)]  # noqa: SIM115
    Path(opts.log_dir).mkdir(parents=True, exist_ok=True)
    return [open(Path(opts.log_dir) / f"{tag}-rank{r}.log", "w") for r in range(n)]  # noqa: SIM115


COLD_STREAM_MB = 64  # > any L3 here: a decode step streams ~40 MB of weights between all-reduces


def run_collectives(hosts: Hosts, world: int, sizes: list[int], backend: str, iters: int) -> dict:
    """Our ring or gloo all-reduce between `world` ranks on `hosts`; rank 0's JSON."""
    secret = secrets.token_hex(16)
    port = BASE_PORT + 50 if backend == "gloo" else BASE_PORT + 60
    peers = ",".join(f"{hosts.address(r)}:{port + r}" for r in range(world))
    argv = [sys.executable, "-m", "tandem.bench.collective_run", "--backend", backend,
            "--world", str(world), "--master", f"{hosts.address(0)}:{port}", "--peers", peers,
            "--secret", secret, "--bytes", ",".join(map(str, sizes)), "--iters", str(iters)]  # fmt: skip
    if backend == "ring":
        argv += ["--cold-mb", str(COLD_STREAM_MB)]  # the op as decode meets it (plan calibration)
    procs = []
    for r in range(world):
        env = {"GLOO_SOCKET_IFNAME": hosts.device(r), "OMP_NUM_THREADS": "1"}
        procs.append(hosts.popen(r, [*argv, "--rank", str(r)], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    out, err = procs[0].communicate(timeout=300)
    for p in procs[1:]:
        p.wait(timeout=60)
    if procs[0].returncode != 0:
        raise HostProcessFailed(f"{backend} all-reduce on {hosts.name}: {err[-1500:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_bench(opts: BenchOptions, log: Callable[[str], None] = print) -> dict:
    config, facts = describe_model(opts.model_dir)
    max_ranks = max(lay.n for lay in opts.layouts)
    doc: dict = {"machine": machine_info(), "options": _options_dict(opts),
                 "model": {"dir": opts.model_dir, **facts, **asdict(config)},
                 "links": {}, "runs": [], "allreduce": [], "peers": {},
                 "lockstep": {}}  # fmt: skip
    try:
        check_available()
        net = EmulatedNetwork.new(max(max_ranks, 3), Shaping(rate_mbit=opts.rate_mbit))
        stale = stale_namespaces()
        if stale:  # a run killed with SIGKILL cannot clean up; say so, do not touch them
            log(f"note: namespaces left by an earlier killed run: {', '.join(stale)} "
                "(remove with `ip netns del NAME`)")  # fmt: skip
    except NetnsUnavailable as e:
        if "emulated" in opts.links:
            raise
        log(f"no namespaces ({e}): loopback in the root namespace, no byte counters")
        net = None
    hidden_bytes = 4 * config.hidden_size
    sizes = [hidden_bytes, 4 * config.hidden_size * opts.prompt_len, 4 << 20]
    ctx = net.up() if net is not None else _null()
    with ctx:
        for link in opts.links:
            hosts = Hosts(max(max_ranks, 3), net, loopback=(link == "loopback"))
            with hosts:
                fig = hosts.measure_link(0, 0 if link == "loopback" else 1)
                doc["links"][link] = {"name": hosts.name, **asdict(fig)}
                log(f"{hosts.name}: rtt {fig.rtt_s * 1e6:.0f} us, goodput "
                    f"{fig.goodput_bytes_per_s / 1e6:.0f} MB/s")  # fmt: skip
                if opts.collectives:
                    for world in sorted({2, *(lay.n for lay in opts.layouts if lay.kind == "tp")}):
                        for backend in ("ring", "gloo") + (("socket",) if world == 2 else ()):
                            try:
                                r = run_collectives(hosts, world, sizes, backend, iters=200)
                            except (HostProcessFailed, subprocess.TimeoutExpired) as e:
                                log(f"  {backend} all-reduce x{world} failed: {e}")
                                continue
                            doc["allreduce"].append({"link": link, **r})
                            s0 = r["sizes"][0]
                            log(f"  {backend:>4} all-reduce x{world}, {s0['bytes']} B: "
                                f"{s0['median_s'] * 1e6:.0f} us median")  # fmt: skip
                if opts.probes and any(lay.kind == "tp" for lay in opts.layouts):  # near TP runs
                    doc["lockstep"][link] = _lockstep(config, opts, log, hosts, link)
                passes: list[list[dict]] = [[] for _ in opts.layouts]
                for _ in range(max(1, opts.passes)):  # every layout once a pass: a burst of
                    for i, lay in enumerate(opts.layouts):  # load spoils one pass, not one layout
                        try:  # single again on each link: a control close in time
                            passes[i].append(run_layout(hosts, lay, opts, log))
                        except (HostProcessFailed, subprocess.TimeoutExpired, OSError) as e:
                            log(f"  {lay.name} on {hosts.name} failed: {e}")
                            passes[i].append({"layout": lay.name, "link": hosts.name,
                                              "error": str(e)})  # fmt: skip
                doc["runs"] += [best_pass(runs) for runs in passes]
    if opts.probes and any(lay.kind == "tp" for lay in opts.layouts):
        try:
            doc["concurrency"] = measure_concurrency(opts)
            log(f"2 decodes at once: {doc['concurrency']['slots']:.2f}x the throughput of one")
        except (HostProcessFailed, subprocess.TimeoutExpired) as e:
            log(f"concurrency measurement failed: {e}")
    if opts.hf_peer and facts["gguf"]:  # transformers would dequantize the file to float
        log("HF transformers peer skipped: the model is a GGUF file")
    elif opts.hf_peer:
        doc["peers"]["hf"] = _hf_peer(opts, log)
    doc["machine"]["loadavg_end"] = machine_info()["loadavg"]
    return doc


def _lockstep(
    config, opts: BenchOptions, log: Callable[[str], None], hosts: Hosts, link: str
) -> dict:
    """The lockstep probe at every TP degree measured, its ranks on the link's hosts as the TP
    layouts' are (all on this machine, joined by that link), its shards in a GGUF file's block
    types; the report turns it into the plan's per-sync penalty against the same link's
    all-reduce."""
    from tandem.plan.lockstep import LockstepProbeError, file_weight_types, measure_lockstep

    ks = tuple(sorted({lay.n for lay in opts.layouts if lay.kind == "tp"}))
    types = file_weight_types(opts.model_dir)
    try:
        probe = measure_lockstep(config, ks=ks, hosts=hosts, link=link, types=types)
    except (LockstepProbeError, subprocess.TimeoutExpired) as e:
        log(f"lockstep probe failed: {e}")
        return {"error": str(e)}
    for k, f in probe["by_k"].items():
        log(f"lockstep probe x{k}: segment alone {f['alone_s'] * 1e6:.0f} us, with all-reduce "
            f"in lockstep {f['lockstep_s'] * 1e6:.0f} us per sync")  # fmt: skip
    return probe


def _hf_peer(opts: BenchOptions, log: Callable[[str], None]) -> dict:
    argv = [sys.executable, "-m", "tandem.bench.hf_peer", "--model", opts.model_dir,
            "--prompt-len", str(opts.prompt_len), "--decode", str(opts.decode),
            "--rounds", str(opts.rounds),
            "--dtype", opts.dtype, "--threads", str(opts.threads)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=opts.timeout_s)
    if proc.returncode != 0:
        log(f"HF peer failed: {proc.stderr[-1500:]}")
        return {"error": proc.stderr[-1500:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"HF transformers: {out['decode_tok_per_s']:.2f} tok/s decode, TTFT {out['ttft_s']:.3f} s")
    return out


def _options_dict(opts: BenchOptions) -> dict:
    d = asdict(opts)
    d["layouts"] = [lay.name for lay in opts.layouts]
    return d


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def measure_local_s_per_token(
    config, model_dir: str | None, decode: int = 8, threads: int = 2, dtype: str = "float32"
) -> float:
    """This machine's batch-1 decode time per token on the model (median step of a short run)."""
    import torch

    from tandem.bench.timing import prompt_ids, time_greedy
    from tandem.engine.build import Layout, Limits, build_executor
    from tandem.plan.model import PlanModelError

    if model_dir is None:
        raise PlanModelError("--measure-local needs --model DIR (weights to run)")
    torch.set_num_threads(threads)
    ex = build_executor(model_dir, Layout(dtypes=(DTYPE_NAMES[dtype],)), Limits(2, 64))
    prompt = prompt_ids(16, config.vocab_size)
    time_greedy(ex, prompt[:4], 2, seq_id=1)  # warm-up
    return time_greedy(ex, prompt, decode).decode_s_per_token
