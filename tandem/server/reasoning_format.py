"""Which reasoning format a served model writes, and each choice's output read through it.

    --reasoning-parser auto     harmony where the tokenizer has harmony's marker tokens
                                (<|start|> <|end|> <|message|> <|channel|>: gpt-oss), think where
                                it has <think> and </think> (Qwen3, DeepSeek-R1), else none
    --reasoning-parser harmony | think
                                that format; on its marker tokens where the tokenizer has them,
                                else on the marker strings in the text
    --reasoning-parser none     the output is the content, as the model wrote it

On tokens, the engine keeps the marker tokens out of the text and reports where they came
(`tandem.engine.serving.Mark`), so text that merely spells `<think>` stays text. A choice's parser
is first fed the prompt from its last marker on, so it knows where the output starts: inside
`<think>` when the template opened it (DeepSeek-R1, Qwen3's enable_thinking), in the header of
the assistant message gpt-oss's template began (`<|start|>assistant`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.engine.serving import Mark, TextDelta
from tandem.server import harmony
from tandem.server.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    Marker,
    Parsed,
    Parser,
    Piece,
    PlainParser,
    TextMarkers,
    ThinkParser,
)

CHOICES = ("auto", "none", "think", "harmony")
MARKERS = {"none": (), "think": (THINK_OPEN, THINK_CLOSE), "harmony": harmony.MARKERS}
# where the part of a prompt that the output continues starts: the last of these
ANCHORS = {"none": (), "think": (THINK_OPEN, THINK_CLOSE), "harmony": (harmony.START,)}
# the tokens that must all be single tokens for auto to pick the format
SIGNATURE = {
    "harmony": (harmony.START, harmony.END, harmony.MESSAGE, harmony.CHANNEL),
    "think": (THINK_OPEN, THINK_CLOSE),
}


class ReasoningFormatError(ValueError):
    """A --reasoning-parser value tandem does not know."""


@dataclass(frozen=True)
class ReasoningFormat:
    """A model's reasoning format: `kind` ("none", "think" or "harmony") and its marker tokens
    (`ids`: token id -> marker; empty where the markers are read from the text)."""

    kind: str
    ids: dict[int, str]

    @property
    def marker_ids(self) -> frozenset[int]:
        """The tokens the engine keeps out of the text."""
        return frozenset(self.ids)

    @property
    def on_text(self) -> bool:
        return self.kind != "none" and not self.ids

    def token(self, marker: str) -> int | None:
        """The id of `marker`'s token (None: read from the text)."""
        return next((i for i, m in self.ids.items() if m == marker), None)

    def prompt_tail(
        self, prompt_ids: Sequence[int], decode: Callable[[list[int]], str]
    ) -> list[Piece]:
        """The prompt from its last anchor on (`<think>` or `</think>`; harmony's `<|start|>`),
        as pieces: what the output continues."""
        anchors = ANCHORS[self.kind]
        ids = list(prompt_ids)
        if self.ids:
            at = [k for k, t in enumerate(ids) if self.ids.get(t) in anchors]
            if not at:
                return []
            pieces: list[Piece] = []
            run: list[int] = []
            for t in ids[at[-1] :]:
                if t in self.ids:
                    pieces += _text_pieces(decode(run))
                    pieces.append(Marker(self.ids[t]))
                    run = []
                else:
                    run.append(t)
            return pieces + _text_pieces(decode(run))
        text = decode(ids) if anchors else ""
        last = max((text.rfind(m) for m in anchors), default=-1)
        if last < 0:
            return []
        splitter = TextMarkers(MARKERS[self.kind])
        return [*splitter.split(text[last:]), *splitter.flush()]

    def reader(self, tail: list[Piece], kept: dict[int, str] | None = None) -> ChoiceReader:
        """A fresh reader of one choice's output, primed with the prompt's `tail`; the `kept`
        tokens (id -> text: another format's markers, such as a tool-call format's special
        tokens, which the engine reports as marks) are read as their text."""
        parser: Any
        if self.kind == "harmony":
            parser = harmony.HarmonyParser()
            parser.prime(tail)
        elif self.kind == "think":
            parser = ThinkParser()
            parser.feed(tail)
        else:
            parser = PlainParser()
        splitter = TextMarkers(MARKERS[self.kind]) if self.on_text else None
        return ChoiceReader(parser, self.ids, splitter, kept or {})


def choose(tokenizer: Any, choice: str = "auto") -> ReasoningFormat:
    """The format `choice` names for `tokenizer` (auto: by its marker tokens)."""
    if choice not in CHOICES:
        raise ReasoningFormatError(
            f"--reasoning-parser {choice!r}: not one of {', '.join(CHOICES)}"
        )
    ids = {m: _token_id(tokenizer, m) for kind in ("harmony", "think") for m in MARKERS[kind]}
    if choice == "auto":
        found = [k for k in ("harmony", "think") if all(ids[m] is not None for m in SIGNATURE[k])]
        choice = found[0] if found else "none"
    tokens = {ids[m]: m for m in MARKERS.get(choice, ()) if ids[m] is not None}
    if choice != "none" and not all(ids[m] is not None for m in SIGNATURE[choice]):
        tokens = {}  # not the tokenizer's own markers: read them from the text
    return ReasoningFormat(choice, tokens)  # type: ignore[arg-type]


class ChoiceReader:
    """One choice's output, delta by delta (`read`), through its parser: the text between the
    engine's marks and the marks as `Marker`s, or the text split by `TextMarkers`."""

    def __init__(
        self,
        parser: Parser,
        ids: dict[int, str],
        splitter: TextMarkers | None,
        kept: dict[int, str] | None = None,
    ) -> None:
        self.parser = parser
        self.ids = ids
        self.kept = kept or {}
        self.splitter = splitter
        self.seen = 0  # characters of the choice's text read so far

    def read(self, delta: TextDelta) -> Parsed:
        pieces: list[Piece] = []
        at = 0
        for mark in delta.marks:
            cut = min(max(mark.offset - self.seen, at), len(delta.text))
            pieces += self._text(delta.text[at:cut])
            if mark.token_id in self.kept and mark.token_id not in self.ids:
                pieces.append(self.kept[mark.token_id])
            else:
                pieces.append(Marker(self.ids.get(mark.token_id, "")))
            at = cut
        pieces += self._text(delta.text[at:])
        self.seen += len(delta.text)
        return self.parser.feed(pieces)

    def finish(self) -> Parsed:
        rest = self.parser.feed(self.splitter.flush()) if self.splitter else Parsed()
        return rest.add(self.parser.finish())

    def whole(self, text: str, marks: Sequence[Mark]) -> Parsed:
        """A finished choice's output read at once."""
        return self.read(TextDelta(text, (), tuple(marks))).add(self.finish())

    def _text(self, text: str) -> list[Piece]:
        if not text:
            return []
        return self.splitter.split(text) if self.splitter else [text]


def _text_pieces(text: str) -> list[Piece]:
    return [text] if text else []


def _token_id(tokenizer: Any, text: str) -> int | None:
    find = getattr(tokenizer, "token_id", None)
    return find(text) if callable(find) else None
