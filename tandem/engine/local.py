"""`LocalExecutor`: the whole model on one device; the reference every distributed executor matches.

Each live sequence owns one row ("slot") of the preallocated KV cache; `run` checks the step by
`SequenceCache`'s rule, runs one batched forward (`ShardRunner` over the whole model), and
returns the logits (or greedy ids) at each sequence's last new token.

On construction the model is put in its execution form (`tandem.kernels.prepare`): the fast
modules swapped in and each linear layer on the measured-best kernel for its device and dtype;
`kernels="torch"` keeps the reference modules and F.linear.

With `files` (the model's `ModelFiles`, as `build_executor` gives them), every step first checks
that the files are still the ones opened: a GGUF's quantized weights are read through its
mapping, so a file truncated or replaced under the server fails the step with
`ModelFileChangedError` naming it, and `health()` says so, instead of a SIGBUS on the next read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tandem.engine import cluster_info as ci
from tandem.engine.executor import Step, StepResult
from tandem.engine.rope_rewind import LongRopeRewind
from tandem.engine.runner import ShardRunner
from tandem.engine.sequences import SequenceError
from tandem.kernels.prepare import prepare
from tandem.loaders.file_identity import ModelFiles
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.models.llama import Transformer
from tandem.parallel.moe_reads import whole_model_entry

# the one sequence error under the name this executor has always raised
StepError = SequenceError


class LocalExecutor:
    def __init__(
        self,
        model: Transformer,
        max_batch: int = 8,
        max_seq_len: int = 2048,
        *,
        kernels: str = "auto",
        weight_format: str | None = None,
        files: ModelFiles | None = None,
        experts: dict[str, Any] | None = None,
    ) -> None:
        cfg = model.config
        self.files = files
        self.weight_format = weight_format  # how the weights were stored (for describe)
        self.experts = experts  # a mixture of experts' placement, for describe
        self.kernels = prepare(model, kernel=kernels)  # in place, once
        self.model = model
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = min(max_seq_len, cfg.max_position_embeddings)
        self.max_batch = max_batch
        self.runner = ShardRunner(model, max_batch, self.max_seq_len, swap=False)
        self.slots = self.runner.seqs.slots  # seq_id -> its cache row
        self.rewind = LongRopeRewind.for_config(cfg)  # longrope: a crossing recomputes

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch: int = 8,
        max_seq_len: int = 2048,
        kernels: str = "auto",
    ) -> LocalExecutor:
        md = open_model(path)
        model = load_model(md, dtype=dtype, device=device)
        return cls(model, max_batch, max_seq_len, kernels=kernels, weight_format=md.weight_format(),
                   experts=whole_model_entry(md))  # fmt: skip

    def run(self, step: Step) -> StepResult:
        if self.files is not None:
            self.files.check()  # before any mapped byte is read
        step = self.rewind.expand(step)
        out = self.runner.forward(step)
        assert out is not None  # the whole model: the head is here
        return StepResult.of(step, out)

    def copy_prefix(self, src_seq: int, dst_seq: int, n: int) -> None:
        """New sequence `dst_seq` holds `src_seq`'s first `n` cached positions (`Executor`)."""
        self.runner.copy_prefix(src_seq, dst_seq, n)
        self.rewind.copy(src_seq, dst_seq, n)

    def release(self, seq_ids: list[int]) -> None:
        self.runner.release(seq_ids)
        self.rewind.release(seq_ids)

    def health(self) -> tuple[bool, str]:
        """One process: whole while it runs and its model files are the ones it opened."""
        changed = self.files.change() if self.files is not None else None
        return (False, str(changed)) if changed is not None else (True, "ok")

    def stats(self) -> dict[str, float]:
        """No collectives and no wire."""
        return {}

    def describe(self) -> dict[str, Any]:
        """One rank holding every layer, in this process."""
        m = self.model
        facts = ci.RankFacts(
            rank=0,
            role="head",
            host=ci.hostname(),
            device=str(m.device),
            dtype=str(m.dtype).removeprefix("torch."),
            weight_format=self.weight_format,
            shard={
                **ci.layer_shard((0, m.config.num_hidden_layers)),
                "cache_bytes_per_sequence": self.runner.cache.bytes_per_sequence(),
            },
            work_share=1.0,
            pid=os.getpid(),
            local=True,
            threads=torch.get_num_threads(),
            kernels=self.kernels.variants,
            experts=self.experts,
        )
        return ci.Description("single", 1, 1, [facts]).as_dict()

    def close(self) -> None:
        self.runner.seqs.clear()
        self.rewind.clear()
