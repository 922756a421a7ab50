"""Reasoning apart from the answer: incremental parsers of a model's output into its reasoning,
its content and its tool calls. Pure state machines, fed the output as it streams.

A parser is fed pieces: text, or a `Marker` (a format's marker token, e.g. `<think>`, met as
that token, never as characters; `TextMarkers` makes pieces out of plain text for a tokenizer
that has no such tokens). Each `feed` returns what became certain (`Parsed`: reasoning, content
and whole calls); `finish` the rest. Any split of one output into pieces gives the same result.

    ThinkParser     Qwen3 / DeepSeek-R1: `<think>reasoning</think>content`; `inside` when the
                    prompt opened `<think>` itself, so the output starts in the reasoning
    HarmonyParser   gpt-oss's harmony messages (`tandem.server.harmony`)
    PlainParser     everything is content
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Marker:
    """A marker of the output's format, as the model wrote it (one token, or its text where the
    tokenizer has no such token)."""

    text: str


Piece = str | Marker


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the function's `name`, its `arguments` as JSON text."""

    name: str
    arguments: str


@dataclass
class Parsed:
    """What a stretch of output holds: reasoning text, content text, whole calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class Parser(Protocol):
    def feed(self, pieces: Iterable[Piece]) -> Parsed: ...

    def finish(self) -> Parsed: ...


class PlainParser:
    """No reasoning format: every piece of text is content (markers have no meaning)."""

    def feed(self, pieces: Iterable[Piece]) -> Parsed:
        return Parsed(content="".join(p for p in pieces if isinstance(p, str)))

    def finish(self) -> Parsed:
        return Parsed()


class ThinkParser:
    """`<think>reasoning</think>content`: text between the markers is reasoning, the rest
    content. Whitespace that only frames a section (the newlines after `<think>`, before and
    after `</think>`) is dropped: leading whitespace of a section opened by a marker, and
    trailing whitespace of reasoning, held until more reasoning follows. A second `<think>`
    inside, or a `</think>` outside, is dropped; a reasoning cut short ends without its tail."""

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside
        self.lead = inside  # at a section's start: its leading whitespace is framing
        self.tail = ""  # the reasoning's trailing whitespace, not yet known to be inside it

    def feed(self, pieces: Iterable[Piece]) -> Parsed:
        out = Parsed()
        for p in pieces:
            if isinstance(p, Marker):
                if p.text == THINK_OPEN and not self.inside:
                    self.inside, self.lead = True, True
                elif p.text == THINK_CLOSE and self.inside:
                    self.inside, self.lead, self.tail = False, True, ""
                continue
            text = p.lstrip() if self.lead else p
            if not text:
                continue
            self.lead = False
            if self.inside:
                body = self.tail + text
                kept = body.rstrip()
                out.reasoning += kept
                self.tail = body[len(kept) :]
            else:
                out.content += text
        return out

    def finish(self) -> Parsed:
        return Parsed()


class TextMarkers:
    """Plain text into pieces, the `markers` found in it as `Marker`s. Text that could be the
    start of a marker is held until the next text decides it (`flush` gives it up as text)."""

    def __init__(self, markers: Iterable[str]) -> None:
        self.markers = tuple(sorted({m for m in markers if m}, key=len, reverse=True))
        self.held = ""

    def split(self, text: str) -> list[Piece]:
        s, out, i = self.held + text, [], 0
        while True:
            found = [(j, -len(m), m) for m in self.markers if (j := s.find(m, i)) >= 0]
            if not found:
                break
            j, _, m = min(found)  # the first; of two at one place, the longest
            if j > i:
                out.append(s[i:j])
            out.append(Marker(m))
            i = j + len(m)
        rest = s[i:]
        keep = self._partial(rest)
        if len(rest) > keep:
            out.append(rest[: len(rest) - keep])
        self.held = rest[len(rest) - keep :]
        return out

    def flush(self) -> list[Piece]:
        held, self.held = self.held, ""
        return [held] if held else []

    def _partial(self, text: str) -> int:
        """The length of the longest end of `text` that is a proper beginning of a marker."""
        for k in range(min(len(text), max((len(m) for m in self.markers), default=1) - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return k
        return 0


def parse_all(parser: Parser, pieces: Iterable[Piece]) -> Parsed:
    """The whole of an output, fed at once."""
    return parser.feed(pieces).add(parser.finish())
