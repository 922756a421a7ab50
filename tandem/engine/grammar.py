"""Structured output: a grammar (JSON, a JSON schema, Lark) as a `TokenMask`, by llguidance.

    GrammarVocab (one per tokenizer: every token's bytes, built once, ~1 s for 150k tokens)
      + a grammar (compile_grammar: JSON schema / "any JSON object" / Lark -> llguidance's grammar)
      -> GrammarMask (one per sequence: an `LLMatcher` advanced token by token)

llguidance computes each step's mask in Rust over a token trie (tens of microseconds per token
for JSON schemas), runs on the CPU and needs no torch; it is imported here lazily, so a head
that never constrains a request never loads it. A grammar llguidance refuses raises
`GrammarError` before anything runs. The grammar's end is the tokenizer's EOS tokens: a mask at
the grammar's end allows only them, so the sequence ends as any other does, on EOS.

When the mask is computed: the mask that picks token t+1 depends on token t, and so does step
t+1's forward (token t is its input), so neither can start before token t is sampled, and the
mask for t+2 cannot start before step t+1's logits. What can overlap is the mask for t+1 with
step t+1 itself: `advance(t)` hands the matcher to a small shared worker pool, which computes
the next mask (llguidance drops the GIL while it does) while the head sends step t+1 and the
ranks run it; `allowed()`, asked once step t+1's logits are back, takes the finished mask. In a
batch every sequence's next mask is computed at once on the pool, each beside the step. A new
mask starts its first one at once, beside the prompt's prefill.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.engine.sampling_params import SamplingError

SPECIAL_PREFIX = b"\xff"  # llguidance's mark of a special token: no text ever matches it


class GrammarError(ValueError):
    """A grammar (or JSON schema) the engine cannot compile; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: `kind` "json" (any JSON object when `schema` is
    None, else JSON matching `schema`) or "lark" (`text` is a Lark grammar)."""

    kind: str
    schema: dict[str, Any] | None = None
    text: str | None = None


def compile_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar for `spec` (not yet checked against a vocabulary)."""
    import llguidance

    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.text or "")
    schema = spec.schema if spec.schema is not None else {"type": "object"}
    try:
        # whitespace kept to what JSON needs: a small model left free to indent wanders
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
    except (ValueError, TypeError, RecursionError) as e:
        raise GrammarError(f"not a JSON schema the engine takes: {e}") from e


class _ByteTokenizer:
    """What llguidance's `TokenizerWrapper` reads: each token's bytes (special tokens marked),
    the EOS and BOS ids, and an encoder of bytes."""

    def __init__(
        self,
        tokens: list[bytes],
        eos: int,
        bos: int | None,
        encode: Callable[[str], list[int]],
        special: Sequence[int],
    ) -> None:
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids = list(special)
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class GrammarVocab:
    """A tokenizer's vocabulary as llguidance reads it. `tokens[i]`: token i's bytes (special
    tokens' prefixed with 0xFF so no text matches them); `eos_ids`: the ids that end a sequence."""

    def __init__(
        self,
        tokens: Sequence[bytes],
        eos_ids: Sequence[int],
        encode: Callable[[str], list[int]],
        special_ids: Sequence[int] = (),
        bos_id: int | None = None,
    ) -> None:
        import llguidance

        if not eos_ids:
            raise GrammarError("structured output needs a tokenizer with an EOS token")
        special = set(special_ids) | set(eos_ids)
        marked = [
            SPECIAL_PREFIX + t if i in special and not t.startswith(SPECIAL_PREFIX) else t
            for i, t in enumerate(tokens)
        ]
        self.size = len(marked)
        self.eos_ids = tuple(eos_ids)
        wrapper = llguidance.TokenizerWrapper(
            _ByteTokenizer(marked, eos_ids[0], bos_id, encode, sorted(special))
        )
        self.lltok = llguidance.LLTokenizer(wrapper, n_vocab=self.size, eos_token=list(eos_ids))

    @classmethod
    def of(cls, tokenizer: Any) -> GrammarVocab:
        """The vocabulary of a `tandem.loaders.tokenizer.Tokenizer` (its `token_bytes`, its
        `eos_token_ids`, its special tokens)."""
        n = tokenizer.vocab_size
        tokens = [tokenizer.token_bytes(i) for i in range(n)]
        special = getattr(tokenizer, "special_token_ids", ())
        return cls(
            tokens,
            tokenizer.eos_token_ids,
            tokenizer.encode,
            special,
            getattr(tokenizer, "bos_token_id", None),
        )

    def mask(self, spec: GrammarSpec, ahead: bool = True) -> GrammarMask:
        """A fresh matcher of `spec` over this vocabulary; `GrammarError` where it does not
        compile. `ahead`: each next mask is computed on the worker pool as soon as the token
        before it is known (False: when `allowed()` asks, on the caller's thread)."""
        import llguidance

        grammar = compile_grammar(spec)
        err = llguidance.LLMatcher.validate_grammar(grammar, self.lltok)
        if err and not err.startswith("WARNING"):
            raise GrammarError(err)
        matcher = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarMask(matcher, self.size, self.eos_ids, ahead=ahead)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _mask_pool() -> ThreadPoolExecutor:
    """The process's mask workers (as many as CPUs, at most 4), made on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            n = max(1, min(4, os.cpu_count() or 1))
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="tandem-grammar")
        return _POOL


class GrammarMask:
    """One sequence's grammar as a `TokenMask`: `allowed()` is the matcher's next-token mask
    (EOS allowed once the grammar accepts; only EOS once it is complete), `advance(t)` consumes
    `t`. A mask that allows nothing, or a token the grammar does not take, is a `SamplingError`:
    the request fails rather than samples what the grammar forbids.

    With `ahead`, the next mask is computed on the worker pool from construction and from each
    `advance` on (see the module's docstring); the matcher is touched by one thread at a time:
    `advance` and `allowed` wait for the computation in flight first."""

    def __init__(self, matcher: Any, size: int, eos_ids: Sequence[int], ahead: bool = True) -> None:
        self.matcher = matcher
        self.size = size
        self.eos_ids = frozenset(eos_ids)
        self.ahead = ahead
        self._words = np.zeros((self.size + 31) // 32, dtype=np.int32)
        self._next: Future[np.ndarray] | None = None
        self._start_next()

    def _start_next(self) -> None:
        if self.ahead:
            self._next = _mask_pool().submit(self._compute)

    def _take_next(self) -> np.ndarray | None:
        """The mask computed ahead (its error raised here), or None when none is in flight."""
        pending, self._next = self._next, None
        return pending.result() if pending is not None else None

    def allowed(self) -> np.ndarray:
        ready = self._take_next()
        return ready if ready is not None else self._compute()

    def _compute(self) -> np.ndarray:
        """The matcher's next-token mask as a (size,) bool array."""
        m = self.matcher
        if m.is_stopped():  # the grammar is complete: only its end
            keep = np.zeros(self.size, dtype=bool)
            keep[list(self.eos_ids)] = True
            return keep
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            raise SamplingError(f"the grammar failed: {m.get_error()}")
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.size]
        keep = bits.astype(bool)
        if not keep.any():
            raise SamplingError("the grammar allows no token here")
        return keep

    def advance(self, token: int) -> None:
        try:
            self._take_next()  # the matcher is not to be moved while it computes
        except SamplingError:
            pass  # a mask never asked for: the token below is judged on its own
        m = self.matcher
        if m.is_stopped() and token in self.eos_ids:
            return
        if not m.consume_token(token):
            raise SamplingError(f"the grammar does not take token {token}: {m.get_error()}")
        self._start_next()

    @property
    def accepting(self) -> bool:
        if self._next is not None:
            concurrent.futures.wait([self._next])  # the matcher is busy until then
        return bool(self.matcher.is_accepting())


class GrammarCache:
    """The vocabulary of one tokenizer, built on first use (thread-safe) and kept."""

    def __init__(self, build: Callable[[], GrammarVocab]) -> None:
        self._build = build
        self._vocab: GrammarVocab | None = None
        self._lock = threading.Lock()

    def vocab(self) -> GrammarVocab:
        with self._lock:
            if self._vocab is None:
                self._vocab = self._build()
            return self._vocab

    def mask(self, spec: GrammarSpec, ahead: bool = True) -> GrammarMask:
        return self.vocab().mask(spec, ahead)
