"""Shared by the tensor-parallel tests: small random Llama-family models with a clear logit spread."""

from __future__ import annotations

import torch

from tandem.config import ModelConfig
from tandem.engine.executor import Step, StepResult, StepSequence
from tandem.models.llama import Transformer


def tiny_config(arch: str = "Qwen3ForCausalLM", **kw) -> ModelConfig:
    base = dict(
        architecture=arch,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=256,
        qk_norm=arch == "Qwen3ForCausalLM",
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_word_embeddings=arch == "Qwen3ForCausalLM",
    )
    base.update(kw)
    return ModelConfig(**base)


def random_reference(config: ModelConfig, seed: int = 0, std: float = 0.2) -> Transformer:
    """A float32 reference model with N(0, std) weights (norm weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.eval()


class ModelExecutor:
    """A reference model in memory as an Executor (a ShardRunner over the whole model)."""

    def __init__(self, model, max_batch: int = 4, max_seq_len: int = 64):
        from tandem.engine.runner import ShardRunner

        self.runner = ShardRunner(model, max_batch, max_seq_len)

    def run(self, step):
        return StepResult.of(step, self.runner.forward(step))

    def release(self, ids):
        self.runner.release(ids)


def tp_greedy_in_process(config, ref, n, prompts, n_new, *, check=None, **plan_kw):
    """Greedy through an N-rank TPExecutor over in-process ranks (`ReferenceCommunicator`), each
    shard loaded from `ref`'s state dict; `plan_kw` goes to `plan_for_config` (weights,
    attn_ranks); `check(rank, model, runner)` runs on every rank once its shard is built.
    -> every rank's return value (rank 0: greedy's; the others: the steps they served)."""
    from tandem.comm.reference import ReferenceCommunicator, run_ranks
    from tandem.engine.runner import ShardRunner
    from tandem.engine.tp.head import TPExecutor
    from tandem.engine.tp.worker import BroadcastSource, serve
    from tandem.parallel.plan import plan_for_config
    from tandem.parallel.shard_load import load_shard
    from tandem.parallel.transform import shard_transformer

    plan = plan_for_config(config, n, **plan_kw)
    state = ref.state_dict()

    def body(comm):
        model = shard_transformer(config, plan, comm)
        load_shard(model, StateDictReader(state), plan, comm.rank)
        runner = ShardRunner(model, max_batch=4, max_seq_len=64)
        if check is not None:
            check(comm.rank, model, runner)
        if comm.rank != 0:
            return serve(runner, BroadcastSource(comm))
        ex = TPExecutor(runner, comm, config.vocab_size)
        try:
            return greedy(ex, prompts, n_new)
        finally:
            ex.close()

    return run_ranks(ReferenceCommunicator.group(n), body)


class StateDictReader:
    """A `SliceReader` over an in-memory state dict (the in-process tests' checkpoint)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def read(self, name, dim=None, start=None, end=None, experts=None):
        t = self.state[name] if experts is None else self.state[name][experts[0] : experts[1]]
        return t if dim is None else t.narrow(dim, start, end - start).clone()


def greedy(
    executor, prompts: list[list[int]], n_new: int, on_ranks: bool = False
) -> tuple[list[list[int]], torch.Tensor | None]:
    """Greedy-decodes every prompt as one batch through any `Executor`; returns the new ids of each
    and the first step's (prefill) last-position logits. `on_ranks`: every step is a `greedy` step
    (the executor returns argmax ids, so no logits; `first` is None)."""
    from tandem.engine.executor import Step, StepSequence

    seqs = {i: list(p) for i, p in enumerate(prompts)}
    out: list[list[int]] = [[] for _ in prompts]
    step = Step(tuple(StepSequence(i, tuple(p), 0) for i, p in seqs.items()), on_ranks)
    first = None
    for _ in range(n_new):
        result = executor.run(step)
        if on_ranks:
            got = result.token_ids
            assert got.dtype == torch.int64 and got.shape == (len(prompts),)
            nxt = got.tolist()
        else:
            got = result.logits
            if first is None:
                first = got
            nxt = got.argmax(-1).tolist()
        entries = []
        for i, t in enumerate(nxt):
            out[i].append(t)
            entries.append(StepSequence(i, (t,), len(seqs[i])))
            seqs[i].append(t)
        step = Step(tuple(entries), on_ranks)
    executor.release(list(seqs))
    return out, first


class SingleNode:
    """The single-device reference as an `Executor`: the whole model loaded from its source
    (`open_model`: a safetensors directory, an MXFP4 checkpoint, a GGUF file)."""

    def __init__(self, model_dir, dtype=torch.float32, max_batch: int = 4, max_seq_len: int = 128):
        from tandem.engine.runner import ShardRunner
        from tandem.loaders.load import load_model
        from tandem.loaders.source import open_model

        self.model = load_model(open_model(model_dir), dtype=dtype)
        self.runner = ShardRunner(self.model, max_batch, max_seq_len)
        self.vocab_size = self.model.config.vocab_size

    def run(self, step):
        return StepResult.of(step, self.runner.forward(step))

    def release(self, ids):
        self.runner.release(ids)

    def close(self):
        pass


def write_random_model(out, config: ModelConfig, seed: int = 0):
    """A model directory (config.json + model.safetensors) with the presets' dtype-stable init."""
    from tandem.loaders.writer import write_model_dir
    from tandem.models.presets import random_weights

    write_model_dir(out, config, random_weights(config, seed, torch.float32))
    return out


# Steps over two sequences that rewind: seq 0 goes back to position 4 with other tokens (a
# re-prefill in the same step as seq 1's decode token), then seq 1 back to position 0. Token ids
# below 97 (the smallest test vocabulary).
REWIND_SCRIPT = [
    ((0, (5, 17, 33, 2, 8, 90, 7), 0), (1, (9, 9, 9, 1, 2, 3, 4, 70, 11, 12), 0)),
    ((0, (11,), 7), (1, (12,), 10)),
    ((0, (13,), 8), (1, (14,), 11)),
    ((0, (50, 51, 52), 4), (1, (15,), 12)),
    ((0, (16,), 7), (1, (60, 61), 0)),
    ((0, (17,), 8), (1, (18,), 2)),
]


def run_rewind_script(executor) -> list[torch.Tensor]:
    """Each step's logits (2, vocab) for `REWIND_SCRIPT` through any `Executor`; both sequences
    released at the end."""
    from tandem.engine.executor import Step, StepSequence

    out = []
    for seqs in REWIND_SCRIPT:
        step = Step(tuple(StepSequence(i, tuple(t), pos) for i, t, pos in seqs))
        out.append(executor.run(step).logits)
    executor.release([0, 1])
    return out


def assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = 1e-4):
    """Step by step: the logits within `atol` and the same argmax per row."""
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g - w).abs().max().item() < atol, f"step {k}"
        assert g.argmax(-1).tolist() == w.argmax(-1).tolist(), f"step {k}"


def greedy_with_gaps(executor, prompt: list[int], n_new: int):
    """Greedy ids plus, per step, the top-1 minus top-2 logit gap."""
    from tandem.engine.executor import Step, StepSequence

    ids, gaps = [], []
    step = Step((StepSequence(0, tuple(prompt), 0),))
    pos = len(prompt)
    for _ in range(n_new):
        logits = executor.run(step).logits[0]
        top = torch.topk(logits.float(), 2).values
        gaps.append(float(top[0] - top[1]))
        t = int(logits.argmax())
        ids.append(t)
        step = Step((StepSequence(0, (t,), pos),))
        pos += 1
    executor.release([0])
    return ids, gaps


def _kernels_per_rank(kernels, tp: int) -> list[str]:
    return [kernels] * tp if isinstance(kernels, str) else list(kernels)


def launch_concurrently(specs: dict, **common) -> dict:
    """`launch_local_tp` for several groups at once (worker start-up dominates on a small machine):
    every group's workers are spawned from this thread (the parent-death signal follows the
    spawning thread), then the heads form their groups on helper threads. `specs` maps a key to
    (model_dir, tp, extra kwargs). Every group formed is closed if any fails."""
    from concurrent.futures import ThreadPoolExecutor

    from tandem.cluster.launcher import free_ports
    from tandem.engine.tp.local import LocalWorkers, launch_local_tp

    # every group's ports taken together: distinct across groups, not only within one
    ports = iter(free_ports(sum(tp for _, tp, _ in specs.values())))
    started = {}
    for key, (model_dir, tp, kw) in specs.items():
        opts = {**common, **kw}
        started[key] = LocalWorkers(
            model_dir,
            tp,
            dtypes=opts.get("dtypes") or ["float32"] * tp,
            devices=opts.get("devices") or ["cpu"] * tp,
            op_timeout=opts.get("op_timeout", 60.0),
            handshake_timeout=opts.get("handshake_timeout", 120.0),
            threads=opts.get("threads"),
            kernels=_kernels_per_rank(opts.get("kernels", "auto"), tp),
            ports=[next(ports) for _ in range(tp)],
        )

    def one(key):
        model_dir, tp, kw = specs[key]
        return launch_local_tp(model_dir, tp, workers=started[key], **{**common, **kw})

    out: dict = {}
    errors = []
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = {key: pool.submit(one, key) for key in specs}
        for key, f in futures.items():
            try:
                out[key] = f.result()
            except Exception as e:  # noqa: BLE001 - re-raised after cleanup
                errors.append(e)
    if errors:
        for ex in out.values():
            ex.close()
        for w in started.values():
            w.shutdown()
        raise errors[0]
    return out


def close_concurrently(executors) -> None:
    """Closes every executor on a thread of its own: each close waits for its own worker processes
    to leave (interpreter shutdown, ~1.5 s on a loaded 2-core machine), so the waits overlap
    instead of adding up. Every executor is closed; the first error is raised after."""
    from concurrent.futures import ThreadPoolExecutor

    executors = list(executors)
    if not executors:
        return
    with ThreadPoolExecutor(max_workers=len(executors)) as pool:
        futures = [pool.submit(ex.close) for ex in executors]
    for f in futures:
        f.result()


def greedy_steps(ex, prompt: list[int], n: int) -> list[tuple[int, torch.Tensor]]:
    """n greedy steps of one sequence through an Executor, prefill first: (id, float32 logits)
    per step."""
    seq, out, pos = list(prompt), [], 0
    for _ in range(n):
        logits = ex.run(Step((StepSequence(0, tuple(seq[pos:]), pos),))).logits[0]
        pos = len(seq)
        seq.append(int(logits.argmax()))
        out.append((seq[-1], logits.float()))
    return out


def write_ring_configs(
    tmp, cluster_id: str, op_timeout: float, dial=None, ports=None, heartbeat_timeout=None
) -> list:
    """RING_CONFIG files (`tmp/ring{r}.json`) for a two-rank loopback ring with a fresh secret:
    rank r listens on `ports[r]` and dials `dial[r]` (by default the other rank's port; a test
    puts a proxy's port there), rank 1 finds the master at `ports[2]`; `heartbeat_timeout`: the
    files' field (None: left out, the default)."""
    import json
    import secrets
    from pathlib import Path

    from tandem.cluster.launcher import free_ports

    p0, p1, master = ports or free_ports(3)
    dial = dial or (p1, p0)
    secret = secrets.token_hex(32)
    files = []
    for rank, port in enumerate((p0, p1)):
        cfg = {
            "rank": rank, "world_size": 2, "port": port, "right_ip": "127.0.0.1",
            "right_port": dial[rank], "master_ip": None if rank == 0 else "127.0.0.1",
            "master_port": master, "secret": secret, "cluster_id": cluster_id,
            "op_timeout": op_timeout, "handshake_timeout": 60,
        }  # fmt: skip
        if heartbeat_timeout is not None:
            cfg["heartbeat_timeout"] = heartbeat_timeout
        f = Path(tmp) / f"ring{rank}.json"
        f.write_text(json.dumps(cfg))
        files.append(f)
    return files


def engine_generate(engine, n: int = 4, wait_s: float = 30.0) -> tuple:
    """One greedy request of `n` tokens on a serving engine (`build_serving_engine`), waited for:
    its (completion, error) pair; a request that does not end within `wait_s` fails the test."""
    import threading

    from tandem.engine.sampling_params import SamplingParams

    done: dict = {}
    ev = threading.Event()

    def on_done(c, e):
        done["result"] = (c, e)
        ev.set()

    engine.generate(
        [1, 2, 3], SamplingParams(max_tokens=n, temperature=0), (), lambda d: None, on_done
    )
    assert ev.wait(wait_s), "generation hung"
    return done["result"]


def stop_mid_generation(engine, proc, op_timeout_s: float, bound_s: float) -> str:
    """SIGSTOP `proc` (a rank of `engine`'s group) while a long greedy request is streaming: the
    request must fail within `bound_s` of the stop (a tenth of the op timeout at most, so a
    heartbeat is what saw it), and the engine turn unhealthy naming a heartbeat. Returns its
    health reason."""
    import signal
    import threading
    import time

    from tandem.engine.sampling_params import SamplingParams

    done: dict = {}
    ev = threading.Event()
    streamed: list = []

    def on_done(c, e):
        done["result"] = (c, e, time.monotonic())
        ev.set()

    engine.generate(
        list(range(1, 40)),
        SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
        (),
        streamed.append,
        on_done,
    )
    while not streamed:  # the generation is under way: steps are running
        time.sleep(0.01)
    proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    assert ev.wait(op_timeout_s / 2), "the request hung"
    completion, error, t_end = done["result"]
    assert error is not None, completion
    assert t_end - t0 <= bound_s < op_timeout_s / 10, (t_end - t0, error)
    ok, why = engine.health()
    assert not ok and "heartbeat" in why, why
    return why
