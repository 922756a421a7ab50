"""Composition: model directory + layout -> executor -> scheduler -> `ServingEngine` (for serve,
launch and bench). Not a command itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tandem.config import ModelConfig
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.loaders.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LayoutUnavailable(RuntimeError):
    """A --tp / --pp layout this build cannot run (yet), or that does not fit the model."""


def _progress(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def build_executor(
    model_dir: Path,
    config: ModelConfig,
    *,
    tp: int,
    pp: int,
    dtype: str,
    device: str,
    max_batch: int,
    max_seq_len: int,
    console: Console,
):
    """The executor for the layout; its `close()` brings down whatever it started."""
    if tp < 1 or pp < 1:
        raise LayoutUnavailable(f"--tp and --pp must be at least 1, got tp={tp} pp={pp}")
    if tp * pp == 1:
        from tandem.loaders.load import load_model
        from tandem.loaders.safetensors_dir import ModelDir

        if dtype not in DTYPES:
            raise LayoutUnavailable(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        with _progress(console) as bar:
            task = bar.add_task("loading weights", total=config.num_hidden_layers)
            model = load_model(ModelDir(model_dir), dtype=DTYPES[dtype], device=device)
            bar.update(task, completed=config.num_hidden_layers)
        return _local_executor(model, max_batch, max_seq_len)
    raise LayoutUnavailable(f"tp={tp} x pp={pp} is not wired into `serve` in this build yet")


def _local_executor(model, max_batch: int, max_seq_len: int):
    try:
        from tandem.engine.local import LocalExecutor
    except ImportError:  # until the single-node executor lands: the TP head at world size 1
        from tandem.comm.solo import SoloCommunicator
        from tandem.engine.remote import TPExecutor
        from tandem.engine.shard_runner import ShardRunner

        runner = ShardRunner(model, max_batch=max_batch, max_seq_len=max_seq_len)
        return TPExecutor(runner, SoloCommunicator(), model.config.vocab_size)
    return LocalExecutor(model, max_batch=max_batch, max_seq_len=max_seq_len)


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
) -> tuple[ServingEngine, Callable[[], None]]:
    """A started engine and the function that stops it (scheduler first, then the executor)."""
    console = console or Console(stderr=True)
    config = ModelConfig.from_dir(model_dir)
    seq_len = min(max_seq_len or 2048, config.max_position_embeddings)
    tokenizer = Tokenizer.from_dir(model_dir)
    if tokenizer is None:
        raise LayoutUnavailable(f"{model_dir}: no tokenizer.json; the server needs a tokenizer")
    executor = build_executor(
        model_dir,
        config,
        tp=tp,
        pp=pp,
        dtype=dtype,
        device=device,
        max_batch=max_batch,
        max_seq_len=seq_len,
        console=console,
    )
    eos = tuple(config.eos_token_ids) + tuple(tokenizer.eos_token_ids)
    scheduler = Scheduler(executor, eos_token_ids=eos)
    chat = tokenizer.apply_chat_template if tokenizer.has_chat_template else None
    health = getattr(executor, "health", None)
    engine = ServingEngine(
        scheduler,
        tokenizer,
        name or model_dir.resolve().name,
        chat_template=chat,
        health=health if callable(health) else None,
    )
    scheduler.start()

    def close() -> None:
        scheduler.stop()
        executor.close()

    return engine, close
