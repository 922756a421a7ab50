"""One choice's answer as both APIs return it: its reasoning, its content and its tool calls,
read from the engine's deltas by the model's reasoning format (`reasoning_format`) and, with
tools in play (`parse`), its tool-call format (`call_stream`, `tool_formats`).

Reasoning and content stream as they are read. A call streams as OpenAI's `delta.tool_calls`
do: its index, id, type and name first, then its arguments in pieces (`Part.deltas`); and it is
returned whole once it ends (`Part.calls`, what a whole answer and Ollama's lines carry). Calls
in the reasoning format itself (harmony's) come whole as each ends. A choice that made a call
finishes with "tool_calls" (or "length" where the token limit cut it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.serving import Completion, TextDelta
from tandem.server import call_stream as cs
from tandem.server.reasoning import Parsed
from tandem.server.reasoning_format import ChoiceReader
from tandem.server.tool_formats import ServedFormat
from tandem.server.tools import HERMES


@dataclass
class Part:
    """A stretch of a choice's answer: reasoning, content, the calls that ended in it (OpenAI's
    `tool_calls` shape: id, type, function: name and arguments as JSON text) and the stretch's
    `tool_calls` deltas (index, then id, type and name first, arguments in pieces)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    deltas: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Part) -> Part:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)
        self.deltas.extend(other.deltas)
        return self


class ChoiceAnswer:
    """One choice, delta by delta (`read`), then `finish`; or whole (`whole`)."""

    def __init__(self, reader: ChoiceReader, parse: bool, served: ServedFormat = HERMES) -> None:
        self.reader = reader
        self.stream = cs.CallStream(served.format.syntax) if parse else None
        self.new_id = served.format.new_id
        self.made: list[dict[str, Any]] = []  # every call, in OpenAI's shape, as it grows
        self.ours: dict[int, int] = {}  # the call stream's index -> the call's index in `made`

    @property
    def called(self) -> bool:
        return bool(self.made)

    def read(self, delta: TextDelta) -> Part:
        return self._part(self.reader.read(delta), final=False)

    def finish(self) -> Part:
        return self._part(self.reader.finish(), final=True)

    def whole(self, done: Completion) -> Part:
        """A finished choice read at once."""
        return self.read(TextDelta(done.text, (), tuple(done.marks))).add(self.finish())

    def finish_reason(self, done: Completion) -> str:
        """ "tool_calls" for a choice that made a call, unless the token limit cut it ("length",
        as OpenAI: the last call's arguments may be unfinished)."""
        return (
            "tool_calls" if self.called and done.finish_reason != "length" else done.finish_reason
        )

    def _part(self, parsed: Parsed, final: bool) -> Part:
        part = Part(parsed.reasoning)
        for c in parsed.calls:  # whole, from the reasoning format
            k = self._new(part, c.name)
            self._args(part, k, c.arguments)
            part.calls.append(self.made[k])
        if self.stream is None:
            part.content = parsed.content
            return part
        events = self.stream.feed(parsed.content)
        if final:
            events += self.stream.finish()
        for e in events:
            if isinstance(e, cs.Content):
                part.content += e.text
            elif isinstance(e, cs.Start):
                self.ours[e.index] = self._new(part, e.name)
            elif isinstance(e, cs.Args):
                self._args(part, self.ours[e.index], e.text)
            else:
                part.calls.append(self.made[self.ours[e.index]])
        return part

    def _new(self, part: Part, name: str) -> int:
        k = len(self.made)
        call = {"id": self.new_id(), "type": "function", "function": {"name": name}}
        self.made.append({**call, "function": {"name": name, "arguments": ""}})
        part.deltas.append({"index": k, **call, "function": {"name": name, "arguments": ""}})
        return k

    def _args(self, part: Part, k: int, text: str) -> None:
        self.made[k]["function"]["arguments"] += text
        last = part.deltas[-1] if part.deltas else None
        if last is not None and last["index"] == k:  # this stretch's piece of the same call
            last["function"]["arguments"] += text
        else:
            part.deltas.append({"index": k, "function": {"arguments": text}})
