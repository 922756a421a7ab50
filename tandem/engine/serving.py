"""Text in, text out: the engine the HTTP server talks to (tokenizer + chat template + scheduler).

`ServingEngine.generate` turns a prompt into a stream of text deltas. Detokenization is incremental
and careful at the two places streaming goes wrong: a multi-byte character split across tokens is held
back until it is complete, and text that might be the beginning of a stop string is held back until it
is known not to be one, so a stop string never leaks into the output, streamed or not.

With logprobs asked for, each delta carries the tokens whose text starts in it (`OutputToken`,
with its offset in the completion's text); a token whose text starts past the end of a text cut
at a stop string is not reported, and one that ends the request (EOS, a stop id) neither.

A request may name marker tokens (a reasoning format's `<think>`, harmony's `<|channel|>`): those
are kept out of the text and reported as `Mark`s, each with the offset in the text it came at,
in the delta that shows the text before it; so a reader can tell the model's marker token from
the same characters written as text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.engine.grammar import GrammarCache, GrammarError, GrammarMask, GrammarSpec, GrammarVocab
from tandem.engine.logits_process import TokenLogprobs, TokenMask
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import EngineUnavailable, Request, RequestRejected, Scheduler
from tandem.loaders.errors import ChatTemplateError, TemplateLimitError

__all__ = [
    "Completion",
    "EngineUnavailable",
    "Mark",
    "OutputToken",
    "PromptRejected",
    "RequestRejected",
    "ServingEngine",
    "TextDelta",
    "TextStream",
    "TextTokenizer",
]


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class OutputToken:
    """A generated token with its logprobs (`TokenLogprobs`) and `offset`, the characters of the
    completion's text before its own."""

    logprobs: TokenLogprobs
    offset: int


@dataclass(frozen=True)
class Mark:
    """A marker token kept out of the text: `token_id` came after the first `offset` characters
    of the completion's text."""

    offset: int
    token_id: int


@dataclass(frozen=True)
class TextDelta:
    """Text newly safe to show, the tokens (with logprobs, when asked for) whose text starts in
    it, and the marker tokens (`Mark`) that came within or at the end of it, in order; at the end
    of a generation the text may be empty."""

    text: str
    tokens: tuple[OutputToken, ...] = ()
    marks: tuple[Mark, ...] = ()


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, taken from the prefix cache (not prefilled)
    tokens: list[OutputToken] = field(default_factory=list)  # with logprobs, when asked for
    token_ids: list[int] = field(default_factory=list)  # every token generated (no EOS)
    marks: list[Mark] = field(default_factory=list)  # the marker tokens, kept out of `text`


class PromptRejected(RequestRejected):
    """The chat template refused the messages, failed on them, or went past one of its limits
    (`code`: "chat_template_limit" or "chat_template_error"); the client's 400."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class TextStream:
    """Incremental detokenizer with stop strings: feed token ids, get safe-to-show text deltas."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> tuple[str, bool]:
        """(delta, hit_stop): the newly safe text, and whether a stop string just completed.
        `start` (read before the push) is where the token's text begins."""
        self.ids.append(token)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return "", False
        self.text = text
        if self.stop:
            window = max(len(s) for s in self.stop)
            lo = max(0, self.sent - window + 1)
            hits = [i for i in (text.find(s, lo) for s in self.stop) if i >= 0]
            if hits:
                end = max(min(hits), self.sent)
                self.text = text[:end]
                self.stopped = True
                return self._take(end), True
            safe = len(text) - self._partial_stop_suffix(text)
            return self._take(max(safe, self.sent)), False
        return self._take(len(text)), False

    @property
    def start(self) -> int:
        """Where the next token's text begins: the end of the text decoded so far, less an
        unfinished character (which the next token completes, so it begins there too)."""
        return len(self.text)

    def flush(self) -> str:
        """Everything not yet handed out (at the end of a generation that did not hit a stop)."""
        if self.stopped:
            return ""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


class ServingEngine:
    """What `tandem.server` needs: a model name, prompt building, streaming generation, health and
    figures for /metrics. The executor behind the scheduler may be local, TP, PP or both."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: TextTokenizer,
        model_name: str,
        chat_template: Callable[[list[dict[str, Any]]], str] | None = None,
        health: Callable[[], tuple[bool, str]] | None = None,
        executor_stats: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._chat_template = chat_template
        self._health = health
        self._executor_stats = executor_stats
        self.started_at = time.time()
        self.requests_total: dict[str, int] = {}
        self._lock = threading.Lock()
        self._grammar = GrammarCache(self._grammar_vocab)

    @property
    def max_seq_len(self) -> int:
        return self.scheduler.max_seq_len

    @property
    def vocab_size(self) -> int:
        """The width of the executor's logits: every token id a request may name."""
        return self.scheduler.executor.vocab_size

    @property
    def template_takes_tools(self) -> bool:
        """Whether the model's chat template reads `tools` itself (its source names them)."""
        return self.template_reads("tools")

    def template_reads(self, name: str) -> bool:
        """Whether the model's chat template names the variable `name` (`tools`,
        `enable_thinking`, `reasoning_effort`): a template that does not would ignore it."""
        return self._chat_template is not None and name in self.template_source

    @property
    def template_source(self) -> str:
        """The chat template's source ("" where the model has none)."""
        config = getattr(self.tokenizer, "config", None)
        template = config.get("chat_template") if isinstance(config, dict) else None
        return str(template or "")

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of `messages` (and `tools`, for a template that takes them; the
        template's other `variables`, such as `enable_thinking`)."""
        if self._chat_template is not None:
            extra = dict(variables or {})
            if tools:
                extra["tools"] = tools
            try:
                return self._chat_template(messages, **extra)
            except TemplateLimitError as e:
                raise PromptRejected(str(e), "chat_template_limit") from e
            except ChatTemplateError as e:
                raise PromptRejected(str(e), "chat_template_error") from e
        lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
        return "\n".join(lines) + "\nassistant:"

    def encode(self, text: str) -> list[int]:
        """A prompt's ids, with the BOS / EOS the model asks for (`Tokenizer.encode_prompt`)."""
        return list(self.tokenizer.encode_prompt(text))

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: tuple[str, ...],
        on_delta: Callable[[TextDelta], None],
        on_done: Callable[[Completion | None, BaseException | None], None],
        mask: TokenMask | None = None,
        markers: frozenset[int] = frozenset(),
        reuse_prefix: bool = True,
    ) -> Request:
        """Starts a generation; `on_delta` gets text as it becomes safe to show (with the tokens it
        starts, when `params.logprobs` is set, and the `markers` tokens met, as `Mark`s), then
        `on_done` once. `reuse_prefix`: False prefills the whole prompt (`Request`). Raises RequestRejected / EngineUnavailable before anything runs. Cancel
        with `.cancel()`."""
        stream = TextStream(self.tokenizer.decode, stop)
        ids: list[int] = []
        logged: list[OutputToken] = []  # every token reported, in order
        held: list[OutputToken] = []  # reported once text past their start is shown
        last: list[TokenLogprobs] = []
        marks: list[Mark] = []  # every mark reported, in order
        waiting: list[Mark] = []  # reported once the text before them is shown

        def on_logprobs(lp: TokenLogprobs) -> None:
            last.append(lp)

        def on_token(token: int) -> bool:
            ids.append(token)
            if last:
                held.append(OutputToken(last.pop(), stream.start))
            if token in markers:  # kept out of the text: its place in it is all it has
                text, hit = "", False
                waiting.append(Mark(stream.start, token))
            else:
                text, hit = stream.push(token)
            k = 0  # offsets never decrease: the tokens shown are a prefix of those held
            while k < len(held) and held[k].offset < stream.sent:
                k += 1
            shown = held[:k]
            del held[:k]
            logged.extend(shown)
            m = 0  # a mark goes once all the text before it has
            while m < len(waiting) and waiting[m].offset <= stream.sent:
                m += 1
            reached = tuple(waiting[:m])
            del waiting[:m]
            marks.extend(reached)
            if text or shown or reached:
                on_delta(TextDelta(text, tuple(shown), reached))
            return hit

        def on_finish(reason: str, error: BaseException | None) -> None:
            self._count(reason)
            if error is not None or reason in ("error", "cancelled"):
                on_done(None, error or EngineUnavailable(f"request {reason}"))
                return
            tail = stream.flush()
            rest = [t for t in held if not stream.stopped or t.offset < len(stream.text)]
            logged.extend(rest)
            # past a stop string's cut only the marks before it stand
            after = tuple(m for m in waiting if not stream.stopped or m.offset <= len(stream.text))
            marks.extend(after)
            if tail or rest or after:
                on_delta(TextDelta(tail, tuple(rest), after))
            n = len(ids)
            done = Completion(
                stream.text, reason, len(prompt_ids), n, req.cached_tokens, logged, ids, marks
            )
            on_done(done, None)

        req = Request(
            list(prompt_ids),
            params,
            on_token,
            on_finish,
            on_logprobs=on_logprobs if params.logprobs is not None else None,
            mask=mask,
            reuse_prefix=reuse_prefix,
        )
        return self.scheduler.submit(req)

    def grammar_mask(self, spec: GrammarSpec, ahead: bool = True) -> GrammarMask:
        """A fresh mask of `spec` over the tokenizer's vocabulary (built on the first call, ~0.5 s
        for 50k tokens); `GrammarError` where the grammar does not compile. Blocking: call it off
        the event loop. `ahead`: each next mask computed beside the step (`GrammarMask`)."""
        return self._grammar.mask(spec, ahead)

    def _grammar_vocab(self) -> GrammarVocab:
        tok = self.tokenizer
        if not all(hasattr(tok, a) for a in ("token_bytes", "vocab_size", "eos_token_ids")):
            raise GrammarError("structured output needs the model's tokenizer (token bytes, EOS)")
        return GrammarVocab.of(tok)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (the tokenizer's `token_bytes`, else its decoded
        text's UTF-8)."""
        exact = getattr(self.tokenizer, "token_bytes", None)
        if callable(exact):
            return exact(token_id)
        return self.tokenizer.decode([token_id]).encode()

    def health(self) -> tuple[bool, str]:
        if self.scheduler.failure is not None:
            return False, f"the engine failed: {self.scheduler.failure}"
        return (self._health or self.scheduler.executor.health)()

    def metrics(self) -> dict[str, Any]:
        """A snapshot for /metrics: scheduler counters plus the executor's own figures if it has any
        (`executor_stats()` returning e.g. {"collective_seconds": ..., "wire_bytes": ...})."""
        s = self.scheduler.stats
        running, waiting = self.scheduler.load()
        ex_stats = self._executor_stats or self.scheduler.executor.stats
        executor = dict(ex_stats())
        with self._lock:
            finished = dict(self.requests_total)
        return {
            "requests_finished": finished,
            "running": running,
            "waiting": waiting,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "steps": s.steps,
            "step_seconds": s.step_seconds,
            "replayed_sequences": s.replayed_sequences,
            "prefix_cache": self.prefix_cache_stats(),
            "ttft": s.ttft.snapshot(),
            "decode_latency": s.decode_latency.snapshot(),
            "executor": executor,
        }

    def cluster(self) -> dict[str, Any]:
        """`Executor.describe()` (see `tandem.engine.cluster_info`) with the scheduler's live
        counters under "scheduler"; a failed engine reports the state "failed" whatever the
        executor says."""
        desc = self.scheduler.executor.describe()
        if self.scheduler.failure is not None:
            desc["state"] = "failed"
            desc["detail"] = f"the engine failed: {self.scheduler.failure}".splitlines()[0]
        s = self.scheduler.stats
        running, waiting = self.scheduler.load()
        desc["scheduler"] = {
            "steps": s.steps,
            "step_seconds": s.step_seconds,
            "decode_steps": s.decode_steps,
            "decode_seconds": s.decode_seconds,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "running": running,
            "waiting": waiting,
            "prefix_cache": self.prefix_cache_stats(),
        }
        return desc

    def prefix_cache_stats(self) -> dict[str, int] | None:
        """The prefix cache's counters (`PrefixCache.stats`), None when it is off."""
        cache = self.scheduler.prefix_cache
        return None if cache is None else cache.stats()

    def _count(self, reason: str) -> None:
        with self._lock:
            self.requests_total[reason] = self.requests_total.get(reason, 0) + 1
