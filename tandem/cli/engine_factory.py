"""Composition: model (directory or GGUF) + layout -> executor -> scheduler -> `ServingEngine`
(for serve, launch and bench). Not a command itself. Opening the model and its tokenizer imports
no torch; the layout (torch dtypes) and the executors over torch do."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from tandem.cli.threads import local_threads
from tandem.cluster.ring_config import load_ring_config
from tandem.devices import COMPUTE_DTYPES, dtype_names
from tandem.engine.build import (
    BuildHooks,
    Layout,
    LayoutUnavailable,
    Limits,
    build_executor,
    check_fits_alone,
    per_rank,
)
from tandem.engine.lean import lean_executor_for
from tandem.engine.prefix_cache import BlockSize, PrefixCache
from tandem.engine.recovery import with_recovery
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.loaders.chat_template import TemplateLimits
from tandem.loaders.errors import ChatTemplateError, TemplateLimitError
from tandem.loaders.file_identity import ModelFiles
from tandem.loaders.gguf.quantized_dir import QuantizedModelDir
from tandem.loaders.safetensors_dir import ModelDir
from tandem.loaders.source import open_model
from tandem.models.kv_pages import block_positions
from tandem.parallel.fit import sequence_cache_bytes

if TYPE_CHECKING:
    import torch

    from tandem.engine.executor import Executor
    from tandem.loaders.tokenizer import Tokenizer

RELOAD_ENV = "TANDEM_REFORM_RELOAD"  # "1": a re-form reloads the head's shard too (for A/B timing)


def _progress(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


class _ProgressDir(ModelDir):
    """A model directory that reports the bytes of every tensor read (for the loading bar)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.total_bytes = sum(info.nbytes for info in self.manifest.values())
        self.on_read: Callable[[int], None] = lambda n: None

    def read(self, name: str, *args, **kwargs) -> torch.Tensor:
        t = super().read(name, *args, **kwargs)
        self.on_read(t.numel() * t.element_size())
        return t


def serving_layout(
    tp: int,
    pp: int,
    dtype: str,
    device: str,
    ring_config: Path | None = None,
    op_timeout: float | None = None,
    heartbeat_timeout: float | None = None,
) -> Layout:
    """`--tp`, `--pp`, `--dtype`, `--device` (one value, or one per rank) and `--op-timeout` as a
    `Layout`. Ranks that share this machine split its cores (`tandem.cli.threads`)."""
    if ring_config is not None:
        names, devices = [dtype], [device]
        stage_tp: tuple[int, ...] = (1,)
    else:
        if tp < 1 or pp < 1:
            raise LayoutUnavailable(f"--tp and --pp must be at least 1, got tp={tp} pp={pp}")
        stage_tp = (tp,) * pp
        names, devices = per_rank(dtype, tp * pp, "dtype"), per_rank(device, tp * pp, "device")
    bad = [n for n in names if n not in COMPUTE_DTYPES]
    if bad:
        raise LayoutUnavailable(f"--dtype {bad[0]!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
    world = tp * pp
    return Layout(
        stage_tp=stage_tp,
        dtypes=tuple(dtype_names()[n] for n in names),
        devices=tuple(devices),
        ring_config=ring_config,
        # The ranks share this machine's cores: oversubscribed OpenMP pools spin against each
        # other and every collective waits for a descheduled peer.
        threads=local_threads(world) if ring_config is None and world > 1 else None,
        **({} if op_timeout is None else {"op_timeout": op_timeout}),
        **({} if heartbeat_timeout is None else {"heartbeat_timeout": heartbeat_timeout}),
    )


def _keepable(ex: Executor) -> Executor | None:
    """`tp.rejoin.keepable(ex)`, without importing the TP runtime (torch) where no TP head exists."""
    if "tandem.engine.tp.head" not in sys.modules:
        return None
    from tandem.engine.tp.rejoin import keepable

    return keepable(ex)


def build_serving_engine(
    model_dir: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    max_batch: int = 8,
    max_seq_len: int | None = None,
    name: str | None = None,
    console: Console | None = None,
    ring_config: Path | None = None,
    quantize: str | None = None,
    attn_ranks: int | None = None,
    moe: str = "tp",
    reform_timeout: float = 0.0,
    op_timeout: float | None = None,
    shrink_after: float = 0.0,
    heartbeat_timeout: float | None = None,
    pp_weights: str | None = None,
    prefix_cache: bool = True,
    cache_mem: int | None = None,
    template_limits: TemplateLimits | None = None,
) -> tuple[ServingEngine, Callable[[], None]]:
    """A started engine and the function that stops it (scheduler first, then the executor).
    `quantize` ("q8_0", "q4_0", "q4_k"): a safetensors model's matrices quantized as it loads.
    `reform_timeout` > 0: a group that loses a rank is formed again under a new epoch within that
    many seconds (a local group starts new processes; a joined head waits for the lost worker to
    come back), keeping the head's loaded shard when the layout is unchanged, and the scheduler
    replays (`tandem.engine.recovery`); 0: the first loss ends it. `op_timeout`: a local TP
    group's bound on one collective; `heartbeat_timeout`: how long one of its ranks may be silent
    before it counts as lost (`transport.heartbeat`; None: the default, 0: off). `shrink_after` > 0: a group whose lost rank has not come
    back that long after the loss re-forms smaller: a local TP group over one rank fewer (TP=N-1,
    the same dtype and device), a pipeline of one-rank stages over one stage fewer (PP=1: the
    head alone), a joined pair on the head alone (alone: if the whole model fits).
    `pp_weights`: `--pp-weights` of a pipeline ("2,1", or "auto": from the stages' probes).
    `prefix_cache`: keep finished sequences in the executor's idle slots for prompts that
    continue them (`tandem.engine.prefix_cache`); `cache_mem`: at most that many bytes of KV
    blocks only they hold, a block shared with another sequence counted once (`cache_block`;
    None: as many as idle slots). `template_limits`: the chat template's render bounds (None: the
    defaults), checked by a probe render before any weight loads."""
    console = console or Console(stderr=True)
    source = open_model(model_dir, quantize)
    files = ModelFiles.of_source(source)  # what every re-form checks before it starts a rank
    config = source.config
    seq_len = min(max_seq_len or 2048, config.max_position_embeddings)
    tokenizer = source.tokenizer()
    if tokenizer is None:
        raise LayoutUnavailable(f"{model_dir}: no tokenizer; the server needs a tokenizer")
    if template_limits is not None:
        tokenizer.template_limits = template_limits
    check_template(tokenizer, console)
    name = name or model_dir.resolve().name.removesuffix(".gguf")
    # one node on the CPU over a GGUF the torch-free executor runs: no layout, no torch
    if tp == 1 and pp == 1 and ring_config is None and not quantize:
        lean = lean_executor_for(
            source, device=device, dtype=dtype, max_batch=max_batch, max_seq_len=seq_len
        )
        if lean is not None:
            return _start(lean, config, tokenizer, name, prefix_cache, cache_mem)
    # torch from here on: the layout holds torch dtypes
    layout = replace(
        serving_layout(tp, pp, dtype, device, ring_config, op_timeout, heartbeat_timeout),
        attn_ranks=attn_ranks,
        moe=moe,
        pp_weights=pp_weights if pp > 1 else None,
    )
    if isinstance(source, QuantizedModelDir) and (layout.world_size > 1 or ring_config):
        raise LayoutUnavailable(
            "--quantize runs on one node; for --tp / --pp write the file once with "
            "`tandem quantize MODEL_DIR OUT.gguf --type ...` and serve OUT.gguf"
        )
    if layout.world_size == 1 and ring_config is None and isinstance(source, ModelDir):
        with _progress(console) as bar:  # the weights' bytes as they are read
            source = _ProgressDir(model_dir)
            task = bar.add_task("loading weights", total=source.total_bytes)
            source.on_read = lambda n: bar.advance(task, n)
            executor = build_executor(
                model_dir, layout, Limits(max_batch, seq_len), BuildHooks(source=source)
            )
    else:  # a GGUF file's weights stay mapped in their blocks: there is little to wait for
        hooks = BuildHooks(
            status=lambda text: console.status(text + "..."), source=source, notice=console.print
        )
        limits = Limits(max_batch, seq_len)
        last: list = [None]  # the group built last: its head's shard is kept by the next epoch
        reform_bound: float | None = None

        def build(epoch: int):  # epoch > 0: formed again after a loss, its lost ranks restarted
            again = hooks
            if epoch:  # a file changed since the first epoch: said at once, never retried
                files.check()  # each attempt ends by the shrink time (joined), so no shrink is held up
                again = replace(hooks, epoch=epoch, keep=last[0], handshake_timeout=reform_bound)
            ex = build_executor(model_dir, layout, limits, again)
            if os.environ.get(RELOAD_ENV) != "1":
                last[0] = _keepable(ex)  # a TP head; nothing else is held past its group
            return ex

        def shrink(epoch: int):  # the survivors: one rank fewer, each loading its wider shard
            files.check()
            last[0] = None  # the kept shard goes before the wider one loads
            if pp > 1:  # a pipeline of one-rank stages: one stage fewer (PP=1: the head alone)
                small = serving_layout(
                    1, pp - 1, dtype, device, None, op_timeout, heartbeat_timeout
                )
                small = replace(small, pp_weights="auto" if pp_weights == "auto" else None)
                if small.world_size == 1:
                    check_fits_alone(source, small, limits)
            else:
                small = serving_layout(
                    tp - 1, 1, dtype, device, None, op_timeout, heartbeat_timeout
                )
            return build_executor(model_dir, small, limits, replace(hooks, epoch=epoch))

        def shrink_to_head(epoch: int):  # a joined pair's worker never came back: the head alone
            files.check()
            last[0] = None  # the kept shard goes before the whole model loads
            alone = serving_layout(1, 1, dtype, device, None, op_timeout, heartbeat_timeout)
            check_fits_alone(source, alone, limits)
            return build_executor(model_dir, alone, limits, replace(hooks, epoch=epoch))

        local_group = layout.world_size > 1 and ring_config is None
        can_shrink = local_group and (pp == 1 or tp == 1) and "," not in dtype + device
        if ring_config is not None and shrink_after > 0:
            if load_ring_config(ring_config).world_size != 2:
                raise LayoutUnavailable(
                    "--shrink-after with --ring-config: a joined group shrinks from 2 ranks to the "
                    "head alone; a larger joined group re-forms only when its lost ranks return"
                )
            reform_bound, shrink, can_shrink = shrink_after, shrink_to_head, True
        executor = with_recovery(
            build,
            reform_timeout if local_group or ring_config else 0.0,
            shrink=shrink if can_shrink else None,
            shrink_after_s=shrink_after,
        )
    return _start(executor, config, tokenizer, name, prefix_cache, cache_mem)


def check_template(tokenizer: Tokenizer, console: Console) -> None:
    """The chat template's probe render, before any weight loads: a template past its limits
    (`TemplateLimitError`) is refused here; one that fails otherwise is named in a warning and
    its chat requests get the 400."""
    try:
        tokenizer.check_chat_template()
    except TemplateLimitError:
        raise
    except ChatTemplateError as e:
        console.print(f"[yellow]warning:[/] {e}; chat requests will be refused")


def cache_block(executor: Executor, config) -> BlockSize:
    """The executors' KV block as the prefix cache counts it (`engine.prefix_cache.BlockSize`):
    `models.kv_pages.block_positions` of one head's row (head_dim x the compute dtype's bytes)
    positions; its bytes over the whole model, every rank's shard
    (`parallel.fit.sequence_cache_bytes` at that many positions), and a hybrid's recurrent state
    per sequence. Ranks of several dtypes (a bf16 rank beside a float32 head) page their KV in
    blocks of different lengths, all powers of two: the head counts the longest (a whole number
    of every rank's blocks, so a block it counts shared is shared on every rank) at the widest
    dtype's bytes, an upper bound on what the ranks hold, so `--cache-mem` is never exceeded."""
    try:
        dtypes = [r["dtype"] for r in executor.describe()["ranks"]] or ["float32"]
    except (KeyError, IndexError, TypeError):
        dtypes = ["float32"]
    elems = [_ELEM_BYTES.get(d, 4) for d in dtypes]
    tokens = max(block_positions(config.head_dim * e) for e in elems)
    held = sequence_cache_bytes(config, tokens, max(elems))
    return BlockSize(tokens, held["kv"], held["state"])


_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _start(
    executor: Executor, config, tokenizer, name: str, prefix_cache: bool, cache_mem: int | None
) -> tuple[ServingEngine, Callable[[], None]]:
    """The scheduler over `executor` started, the engine over it, and the function that stops
    both (scheduler first, then the executor)."""
    eos = tuple(config.eos_token_ids) + tuple(tokenizer.eos_token_ids)
    # a hybrid's recurrent state continues only from its end (`prefix_cache` module docstring)
    cache = None
    if prefix_cache:
        block = cache_block(executor, config)
        cache = PrefixCache(whole_entries=config.hybrid, block=block, max_bytes=cache_mem)
    scheduler = Scheduler(executor, eos_token_ids=eos, prefix_cache=cache)
    chat = tokenizer.apply_chat_template if tokenizer.has_chat_template else None
    engine = ServingEngine(scheduler, tokenizer, name, chat_template=chat)
    scheduler.start()

    def close() -> None:
        scheduler.stop()
        executor.close()

    return engine, close
