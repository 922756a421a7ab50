"""One choice's answer as both APIs return it: its reasoning, its content and its tool calls,
read from the engine's deltas by the model's reasoning format (`reasoning_format`).

Reasoning and content stream as they are read. Calls in the format itself (harmony's) are
returned whole as each ends. With tools in play (`parse`), the content is held to the end and
its Qwen / Hermes `<tool_call>` blocks returned as calls (`tools.parse_calls`); a choice that
made a call finishes with "tool_calls".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.serving import Completion, TextDelta
from tandem.server import tools
from tandem.server.reasoning import Parsed, ToolCall
from tandem.server.reasoning_format import ChoiceReader


@dataclass
class Part:
    """A stretch of a choice's answer: reasoning, content, and calls in OpenAI's `tool_calls`
    shape (id, type, function: name and arguments as JSON text)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Part) -> Part:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)
        return self


class ChoiceAnswer:
    """One choice, delta by delta (`read`), then `finish`; or whole (`whole`)."""

    def __init__(self, reader: ChoiceReader, parse: bool) -> None:
        self.reader = reader
        self.parse = parse
        self.held = ""  # the content, held to the end where tools are in play
        self.called = False

    def read(self, delta: TextDelta) -> Part:
        return self._part(self.reader.read(delta))

    def finish(self) -> Part:
        part = self._part(self.reader.finish())
        if self.parse:
            content, calls = tools.parse_calls(self.held)
            part.content = (content or "") if calls else self.held
            part.calls += calls
            self.called |= bool(calls)
        return part

    def whole(self, done: Completion) -> Part:
        """A finished choice read at once."""
        return self.read(TextDelta(done.text, (), tuple(done.marks))).add(self.finish())

    def finish_reason(self, done: Completion) -> str:
        return "tool_calls" if self.called else done.finish_reason

    def _part(self, parsed: Parsed) -> Part:
        calls = [openai_call(c) for c in parsed.calls]
        self.called |= bool(calls)
        content = parsed.content
        if self.parse:
            self.held += content
            content = ""
        return Part(parsed.reasoning, content, calls)


def openai_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
