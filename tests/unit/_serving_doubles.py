"""Test doubles for the serving stack: an executor that checks the positions it is fed, and a
character tokenizer. (The real model is exercised end to end in tests/e2e.)"""

import os

import numpy as np
import torch

from tandem.engine import cluster_info as ci
from tandem.engine.executor import Step, StepResult
from tandem.engine.sequences import PrefixCopyError

VOCAB = 50


class HistoryExecutor:
    """Keeps each sequence's tokens like a KV cache would and refuses a wrong start_pos; the logits
    are a smooth function of the whole history, so a token fed at the wrong place changes the output.
    `offset`/`vocab` let the greedy choice land in printable ASCII for the text-level tests.
    `numpy`: results hold numpy arrays (as a torch-free executor's do) instead of torch tensors,
    with the same values. `rewind`: take a step behind a sequence's end as every real executor
    does (positions from start_pos on overwritten; a prefix cache's continuation), else refuse it,
    so a scheduler without one is held to appending. Never more than `max_batch` sequences
    live, as a real executor's slots."""

    def __init__(
        self,
        max_batch=8,
        max_seq_len=64,
        fail_after=None,
        vocab=VOCAB,
        span=VOCAB,
        offset=0,
        numpy=False,
        rewind=False,
        whole_only=False,
    ):
        self.whole_only = whole_only
        self.copies: list[tuple[int, int, int]] = []
        self.numpy = numpy
        self.rewind = rewind
        self.vocab_size = vocab
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.history: dict[int, list[int]] = {}
        self.steps: list[Step] = []
        self.released: list[int] = []
        self.fail_after = fail_after
        self.span, self.offset = span, offset

    def run(self, step: Step) -> StepResult:
        if self.fail_after is not None and len(self.steps) >= self.fail_after:
            raise ConnectionError("rank 1 closed the connection")
        self.steps.append(step)
        assert len(step.sequences) <= self.max_batch
        rows = []
        for s in step.sequences:
            h = self.history.setdefault(s.seq_id, [])
            if self.rewind:
                assert s.start_pos <= len(h), (s, len(h))
                del h[s.start_pos :]
            assert s.start_pos == len(h), (s, len(h))
            h.extend(s.token_ids)
            assert len(h) <= self.max_seq_len
            target = self.offset + (sum(t * (i + 1) for i, t in enumerate(h)) * 31 + 7) % self.span
            rows.append(-np.abs(np.arange(self.vocab_size, dtype=np.float32) - target))
        assert len(self.history) <= self.max_batch, "more live sequences than slots"
        logits = np.stack(rows)  # (B, vocab) float32
        if not self.numpy:
            logits = torch.from_numpy(logits)
        return StepResult(token_ids=logits.argmax(-1)) if step.greedy else StepResult(logits=logits)

    def copy_prefix(self, src, dst, n):
        """`dst` starts with `src`'s first n tokens, by the executors' rule (`whole_only`: a
        hybrid's, a copy of all `src` holds only)."""
        h = self.history.get(src)
        if h is None or not 1 <= n <= len(h) or dst in self.history:
            raise PrefixCopyError(f"copy of {n} from {src} ({h and len(h)}) into {dst}")
        if self.whole_only and n != len(h):
            raise PrefixCopyError(f"a hybrid's copy of {n} of the {len(h)} positions of {src}")
        if len(self.history) >= self.max_batch:
            raise PrefixCopyError("no free slot")
        self.copies.append((src, dst, n))
        self.history[dst] = list(h[:n])

    def release(self, seq_ids):
        self.released.extend(seq_ids)
        for i in seq_ids:
            self.history.pop(i, None)

    def health(self):
        return True, "ok"

    def stats(self):
        return {}

    def describe(self):
        facts = ci.RankFacts(
            rank=0,
            role="head",
            host="test-host",
            device="cpu",
            dtype="float32",
            weight_format=None,
            shard=ci.layer_shard((0, 2)),
            work_share=1.0,
            pid=os.getpid(),
            local=True,
        )
        return ci.Description("single", 1, 1, [facts]).as_dict()

    def close(self):
        pass


class CharTokenizer:
    """One token per character code (< 128)."""

    def encode(self, text):
        return [ord(c) % 128 for c in text]

    def encode_prompt(self, text):
        return self.encode(text)

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class PipelineHistoryExecutor(HistoryExecutor):
    """The double with a pipeline's submit/collect: steps go in, results come back in order."""

    def __init__(self, num_stages=2, **kw):
        super().__init__(**kw)
        self.num_stages = num_stages
        self.pending = []
        self.max_in_flight = 0
        self._tag = 0

    def submit(self, step):
        logits = self.run(step)
        self._tag += 1
        self.pending.append((self._tag, logits))
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return self._tag

    def collect(self):
        return self.pending.pop(0)


class ScriptedExecutor(HistoryExecutor):
    """The double writing `script` (one token per character, as `AsciiTokenizer` reads them)
    after each sequence's prompt, then `eos`: a model whose answer a test chooses (a tool call).
    A prompt must come in one step (a scheduler's `prefill_budget` above its length)."""

    def __init__(self, script, eos=0, **kw):
        super().__init__(**kw)
        self.script, self.eos = script, eos
        self.prompts: list[list[int]] = []
        self._prompt_len: dict[int, int] = {}

    def run(self, step):
        rows = []
        for s in step.sequences:
            h = self.history.get(s.seq_id, [])
            if s.seq_id not in self._prompt_len:
                self._prompt_len[s.seq_id] = len(h) + len(s.token_ids)
                self.prompts.append(h + list(s.token_ids))
        result = super().run(step)
        for s in step.sequences:
            n = len(self.history[s.seq_id]) - self._prompt_len[s.seq_id]  # tokens written so far
            target = ord(self.script[n]) if n < len(self.script) else self.eos
            row = np.full(self.vocab_size, -1e4, dtype=np.float32)  # sampled or not: the script
            row[target] = 0.0
            rows.append(row)
        del result
        logits = np.stack(rows)  # (B, vocab) float32
        if not self.numpy:
            logits = torch.from_numpy(logits)
        return StepResult(token_ids=logits.argmax(-1)) if step.greedy else StepResult(logits=logits)

    def release(self, seq_ids):
        super().release(seq_ids)
        for i in seq_ids:
            self._prompt_len.pop(i, None)


class AsciiTokenizer(CharTokenizer):
    """One token per character code (< 128), token 0 the EOS: what a grammar's vocabulary reads
    (each token's bytes, the EOS and the special ids)."""

    vocab_size = 128
    eos_token_ids = (0,)
    special_token_ids = (0,)
    bos_token_id = None

    def token_bytes(self, token_id):
        return bytes([token_id]) if token_id else b"<eos>"
