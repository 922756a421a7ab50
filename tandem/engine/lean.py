"""`LeanExecutor`: a GGUF model on this host's CPU without torch (`tandem.kernels.lean`), behind
the executor face. Where the weights are a few hundred MB of quantized blocks, torch's resident
runtime (~250 MB) would be most of the process; this path keeps peak RSS near the file's size.
16-bit (BF16 / F16) and F32 layer weights run here too: the native product widens 16-bit ones
in registers, and its cache-blocked prefill beat the torch path's tiled widening on an AVX2 CPU
(73 against 52 tok/s, qwen3-0.6b BF16, 2 threads); on F32 its decode (in the form the timing
chose, `kernels.variant_choice`) reads as fast as the torch path's and its prefill tiles run
~1.1x torch's float32 GEMM (an AMD EPYC Zen 3, 2 threads), without torch's runtime in memory.

The step rule is `SequenceCache`'s, as every executor's; the forward pass is `LeanModel`'s
(float32 activations, the native kernels on the mapped blocks), whose logits the equivalence
tests hold against `LocalExecutor` on the same file (tests/unit/test_lean_executor.py).
`from_file` raises `LeanUnsupportedError` for a model it does not run (Gemma with experts,
a tensor type the kernels lack, no native build); the caller
then takes `LocalExecutor`. A longrope model (Phi-3) recomputes a sequence that crosses its
switch, as `LocalExecutor` does (`engine.rope_rewind`).
A KV cache (float32, at `max_batch` x `max_seq_len`) past the host's available RAM is refused
before it is allocated (`parallel.fit.check_node`: `PlanDoesNotFitError`, naming the bytes).

The weights are read through the file's mapping: every step first checks that the file is still
the one opened (`ModelFiles`: size, inode, mtime; a few microseconds), so a file truncated or
replaced under the server fails the step with `ModelFileChangedError` naming it (and `health()`
says so) instead of a SIGBUS on the next read; a truncation that lands inside a step is named
by the SIGBUS handler (`kernels.mapped_guard`) and ends the process with `MAPPED_FILE_EXIT`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from tandem.devices import host_available_bytes
from tandem.engine.executor import Step, StepResult
from tandem.engine.rope_rewind import LongRopeRewind
from tandem.engine.sequences import SequenceCache
from tandem.kernels import mapped_guard
from tandem.kernels.lean import ops
from tandem.kernels.lean.model import LeanModel, LeanUnsupportedError
from tandem.loaders.file_identity import ModelFiles
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.parallel.fit import check_node

__all__ = ["LeanExecutor", "LeanUnsupportedError", "default_threads", "lean_executor_for"]


def default_threads() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def lean_executor_for(
    model: str | Path | GGUFModel | object,
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_batch: int = 8,
    max_seq_len: int = 2048,
    threads: int | None = None,
) -> LeanExecutor | None:
    """The executor a single-node run of `model` (a path or an opened model source) takes without
    torch, or None where it takes the torch path. It takes it where the model is GGUF and
    `LeanModel` runs it (layer weights quantized, 16-bit or F32, not Gemma with experts; else
    `LeanUnsupportedError` is caught), the run is one node on the CPU (`device` cpu, or auto on a
    host with no accelerator, `devices.host_has_accelerator`) in float32 (`dtype` float32 or auto:
    llama.cpp's choice on the CPU too), and `TANDEM_LEAN` is not "0". The caller has checked the
    run is one node (no TP, PP or ring config, no --quantize).
    Errors in the file itself (corrupt, missing) propagate: the torch path would refuse it the same
    way."""
    from tandem.devices import host_has_accelerator
    from tandem.loaders.source import is_gguf

    if os.environ.get("TANDEM_LEAN", "1") == "0" or dtype not in ("auto", "float32"):
        return None
    if not isinstance(model, GGUFModel) and not (
        isinstance(model, (str, Path)) and is_gguf(model)
    ):  # a safetensors folder or source, or a --quantize one
        return None
    if device not in ("cpu", "auto") or (device == "auto" and host_has_accelerator()):
        return None
    try:
        return LeanExecutor.from_file(
            model, max_batch=max_batch, max_seq_len=max_seq_len, threads=threads
        )
    except LeanUnsupportedError:
        return None


class LeanExecutor:
    def __init__(
        self,
        model: LeanModel,
        max_batch: int,
        max_seq_len: int,
        *,
        weight_format: str | None = None,
        experts: dict[str, Any] | None = None,
        files: ModelFiles | None = None,
    ) -> None:
        self.model = model
        self.weight_format = weight_format
        self.experts = experts  # a mixture of experts' placement, for describe
        self.files = files
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self.seqs = SequenceCache(  # a hybrid's recurrent state: no rewind but to 0
            max_batch, max_seq_len, vocab_size=self.vocab_size, owner="the KV cache",
            pages=getattr(model, "pages", None), recurrent=model.config.hybrid,
        )  # fmt: skip
        self.rewind = LongRopeRewind.for_config(model.config)  # longrope: a crossing recomputes

    @classmethod
    def from_file(
        cls,
        path: str | Path | GGUFModel,
        *,
        max_batch: int = 8,
        max_seq_len: int = 2048,
        threads: int | None = None,
    ) -> LeanExecutor:
        """The GGUF model at `path` (a file, a folder holding one, split parts), or one already
        opened."""
        src = path if isinstance(path, GGUFModel) else GGUFModel(path)
        max_seq_len = min(max_seq_len, src.config.max_position_embeddings)
        check_node(  # the float32 cache against free RAM; the blocks stay mapped from the file
            src.config,
            kv_elem_bytes=4,
            weight_bytes=0,
            free_bytes=host_available_bytes(),
            max_batch=max_batch,
            max_seq_len=max_seq_len,
        )
        files = ModelFiles.of_source(src)
        model = LeanModel(src, max_batch, max_seq_len, threads or default_threads())
        mapped_guard.watch(src)
        from tandem.parallel.moe_reads import whole_model_entry

        return cls(model, max_batch, max_seq_len, weight_format=src.weight_format(), files=files,
                   experts=whole_model_entry(src))  # fmt: skip

    def run(self, step: Step) -> StepResult:
        if self.files is not None:
            self.files.check()  # before any mapped byte is read
        if self.rewind.switch is not None:  # longrope
            self.seqs.check(step)  # a bad step changes nothing, the rewind's record included
            step = self.rewind.expand(step)
        slots = self.seqs.check(step)
        one = self.model.decode_token
        if one is not None and len(slots) == 1 and len(step.sequences[0].token_ids) == 1:
            s = step.sequences[0]  # one decode token: one native call (`lean.token`)
            if step.greedy:
                token = one(slots[0], s.start_pos, s.token_ids[0])
                self.seqs.advance(step)
                return StepResult(token_ids=np.array([token], np.int64))
            logits = np.empty((1, one.vocab), np.float32)  # the result keeps it
            one(slots[0], s.start_pos, s.token_ids[0], logits)
            self.seqs.advance(step)
            return StepResult(logits=logits)
        rows = [(slot, s.start_pos, s.token_ids) for slot, s in zip(slots, step.sequences)]
        logits = self.model.logits(self.model.forward(rows))  # (B, vocab)
        self.seqs.advance(step)
        if step.greedy:
            return StepResult(token_ids=ops.argmax(logits))
        return StepResult(logits=logits)

    def copy_prefix(self, src_seq: int, dst_seq: int, n: int) -> None:
        """New sequence `dst_seq` holds `src_seq`'s first `n` cached positions (`Executor`):
        k[:, dst, :, :n] = k[:, src, :, :n] over every layer, whole blocks by sharing their
        pages (`LeanModel.copy_prefix`)."""
        src, dst = self.seqs.copy(src_seq, dst_seq, n)
        self.model.copy_prefix(src, dst, n)
        self.rewind.copy(src_seq, dst_seq, n)

    def release(self, seq_ids: list[int]) -> None:
        self.seqs.release(seq_ids)
        self.rewind.release(seq_ids)

    def health(self) -> tuple[bool, str]:
        """One process: whole while it runs and its model file is the one it opened."""
        changed = self.files.change() if self.files is not None else None
        return (False, str(changed)) if changed is not None else (True, "ok")

    def stats(self) -> dict[str, float]:
        """No collectives and no wire."""
        return {}

    def describe(self) -> dict[str, Any]:
        """One rank holding every layer, in this process, torch-free."""
        from tandem.engine import cluster_info as ci  # psutil: asked for by the server only

        facts = ci.RankFacts(
            rank=0,
            role="head",
            host=ci.hostname(),
            device="cpu",
            dtype="float32",
            weight_format=self.weight_format,
            shard=ci.layer_shard((0, self.model.config.num_hidden_layers)),
            work_share=1.0,
            pid=os.getpid(),
            local=True,
            threads=self.model.threads,
            kernels=self.model.kernel_choice,
            experts=self.experts,
        )
        return ci.Description("single", 1, 1, [facts]).as_dict()

    def close(self) -> None:
        self.seqs.clear()
        self.rewind.clear()
