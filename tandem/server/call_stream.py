"""Tool calls read out of a model's content as it streams, for any format written as JSON
objects `{"name": ..., "arguments" | "parameters": {...}}` (`tandem.server.tool_formats`): the
content around the calls, each call's name as soon as it is written, then its arguments piece
by piece, the way OpenAI streams `delta.tool_calls`.

A format is a `CallSyntax`: the texts that open a section of calls (`<tool_call>`,
`[TOOL_CALLS]`, `<|python_tag|>`), whether a `{` that starts the output opens one (Llama 3's
bare JSON), whether the section is a JSON array, the separators between its calls, the text
that closes it, whether a call may be written `NAME[ARGS]{...}` (Mistral's newer form, an
id `[CALL_ID]ID` maybe before `[ARGS]`), and a reader of a section that holds no JSON (Llama's
built-in calls, `<|python_tag|>brave_search.call(query="...")` or raw code): the section's text
to the output's end, read whole when the output ends.

    content  <tool_call> {"name": "f", "arguments": {"a": 1}} </tool_call>  content
    ^ Content           ^ Start(0, "f")          ^ Args(0, '{"a": 1}') ^ End(0)

The arguments stream as written (JSON text, tracked to their end by bracket depth outside
strings); a call whose keys come in another order is read whole when its object closes.
Text that opens a section but holds no call goes back to the content as written; text that
could still become an opener is held until the next text decides. Whitespace that only frames
the calls (before a section, after it) is dropped; an output without calls keeps all of it.
Any split of one output into pieces gives the same events, merged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.DOTALL
)
# Mistral's newer form: NAME[ARGS]{...}, or NAME[CALL_ID]ID[ARGS]{...} (Small 3.2's template)
_NAMED = re.compile(r"([A-Za-z0-9_.-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{1,64})?\[ARGS\]")
_WORD = re.compile(r"[A-Za-z0-9_.-]{0,64}")


@dataclass(frozen=True)
class CallSyntax:
    """How a format writes its calls (see the module's docstring)."""

    openers: tuple[str, ...] = ()
    close: str = ""  # "" : the section ends where text that is no call starts
    at_start: bool = False  # a `{` first in the output opens a section
    array: bool = False  # the section is `[call, call]`
    seps: str = ""  # characters allowed between two calls
    named: bool = False  # `NAME[ARGS]{...}` is a call too
    # an opened section whose text is no JSON call: read whole at the output's end into calls
    # (name, arguments as JSON text); None gives it back to the content
    whole: Callable[[str], list[tuple[str, str]] | None] | None = None


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Start:
    index: int
    name: str


@dataclass(frozen=True)
class Args:
    index: int
    text: str


@dataclass(frozen=True)
class End:
    index: int


Event = Content | Start | Args | End
TEXT, SECTION, OBJECT, ARGS, TAIL, WHOLE = "text", "section", "object", "args", "tail", "whole"


def value_end(text: str, depth: int = 0) -> int:
    """The length of the JSON value `text` starts with (after leading whitespace), or of the
    rest of an object or array `depth` levels deep; -1 while it is not complete."""
    in_string = escaped = False
    started = depth > 0
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string, started = True, True
        elif c in "{[":
            depth, started = depth + 1, True
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1 if depth == 0 else -1
        elif not started and c.isspace():
            continue
        elif depth == 0 and started is False:
            # a bare scalar (number, true, false, null): ends before the next delimiter
            m = re.match(r"[^\s,}\]]+", text[i:])
            assert m is not None
            return i + m.end() if i + m.end() < len(text) else -1
    return -1


class CallStream:
    """One output's content, fed as it streams (`feed`), then `finish`: a list of events."""

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self.state = TEXT
        self.buf = ""  # text not yet decided
        self.raw = ""  # the open section's text, given back if it holds no call
        self.calls = 0  # calls started in the output
        self.in_section = 0  # calls started in the open section
        self.bracketed = False  # the open section's `[` was read
        self.seen = False  # content other than whitespace was given out
        self.ws = ""  # the content's trailing whitespace, held
        self.dropped = ""  # the whitespace dropped when the open section opened
        self.lead = False  # drop the content's leading whitespace (a section just closed)
        self.scanned = ""  # the current call's arguments so far (ARGS)
        self.quoted = False  # the arguments are a JSON string holding the JSON
        self.named = False  # the current call was written `NAME[ARGS]{...}`: no object around
        self.out: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self.state in (SECTION, OBJECT):
            rest, self.buf = self.buf, ""
            self._give_back()
            self._content(rest, force=True)
        elif self.state in (ARGS, TAIL):  # cut short: the call ends as written
            if self.state == ARGS and self.quoted:
                self.out.append(Args(self.calls - 1, self.scanned))
            self.out.append(End(self.calls - 1))
        elif self.buf:
            self._content(self.buf)
        self.buf = ""
        self.state = TEXT
        if not self.calls and self.ws:
            self.out.append(Content(self.ws))
        self.ws = ""
        return self._take()

    def _take(self) -> list[Event]:
        out, self.out = self.out, []
        return out

    def _run(self, final: bool) -> None:
        while self.buf and getattr(self, f"_{self.state}")(final):
            pass

    # each state's step: True when it consumed something and the loop should go on

    def _text(self, final: bool) -> bool:
        s = self.syntax
        if s.at_start and not self.seen and not self.calls:
            stripped = self.buf.lstrip()
            if stripped.startswith("{"):
                self._open("", len(self.buf) - len(stripped))
                return True
            if not stripped and not final:
                return False
        found = [(j, o) for o in s.openers if (j := self.buf.find(o)) >= 0]
        if found:
            j, opener = min(found)
            self._content(self.buf[:j])
            self._open(opener, j + len(opener))
            return True
        keep = 0 if final else _partial(self.buf, s.openers)
        self._content(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _open(self, opener: str, skip: int) -> None:
        self.dropped, self.ws = self.ws, ""
        self.raw = opener
        self.buf = self.buf[skip:] if opener else self.buf.lstrip()
        self.state, self.in_section, self.bracketed = SECTION, 0, False

    def _section(self, final: bool) -> bool:
        s = self.syntax
        body = self.buf.lstrip()
        self.raw += self.buf[: len(self.buf) - len(body)]
        self.buf = body
        if not body:
            return False
        if s.array and not self.bracketed and not self.in_section and body[0] == "[":
            self._eat(1)
            self.bracketed = True
            return True
        if s.close and body.startswith(s.close):
            self._eat(len(s.close))
            return self._close()
        if s.close and s.close.startswith(body) and not final:
            return False
        if self.bracketed and body[0] == "]":
            self._eat(1)
            return self._close()
        if self.in_section and body[0] in s.seps:
            self._eat(1)
            return True
        if body[0] == "{":
            self.state = OBJECT
            return True
        if s.named and not self.bracketed:
            m = _NAMED.match(body)
            if m:
                self._eat(m.end())
                self._start(m.group(1), named=True)
                return True
            if _named_prefix(body) and not final:
                return False
        if s.whole is not None and self.raw and not self.in_section:
            self.state = WHOLE  # opened by a marker, not JSON: the rest of the output, read whole
            return True
        return self._fail()

    def _whole(self, final: bool) -> bool:
        if not final:
            return False
        calls = self.syntax.whole(self.buf) if self.syntax.whole else None
        if not calls:
            self.state = SECTION
            return self._fail()
        self._eat(len(self.buf))
        for name, args in calls:
            self.out.append(Start(self.calls, name))
            self.out.append(Args(self.calls, args))
            self.out.append(End(self.calls))
            self.calls += 1
            self.in_section += 1
        self.state = TEXT
        return False

    def _object(self, final: bool) -> bool:
        m = _HEAD.match(self.buf)
        if m:
            self._eat(m.end())
            self._start(json.loads(f'"{m.group(1)}"'))
            return True
        end = value_end(self.buf)
        if end < 0:
            return False
        try:
            obj = json.loads(self.buf[:end])
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return self._fail()
        self._eat(end)
        self._start(obj["name"])
        args = obj.get("arguments", obj.get("parameters", {}))
        self.out.append(Args(self.calls - 1, args if isinstance(args, str) else json.dumps(args)))
        self.out.append(End(self.calls - 1))
        self.state = SECTION
        return True

    def _start(self, name: str, named: bool = False) -> None:
        self.out.append(Start(self.calls, name))
        self.calls += 1
        self.in_section += 1
        self.scanned, self.quoted, self.named = "", False, named
        self.state = ARGS

    def _args(self, final: bool) -> bool:
        if not self.scanned:
            body = self.buf.lstrip()
            self.raw += self.buf[: len(self.buf) - len(body)]
            self.buf = body
            if not body:
                return False
            self.quoted = body[0] == '"'
        text = self.scanned + self.buf
        end = value_end(text)
        piece = self.buf if end < 0 else text[len(self.scanned) : end]
        self._eat(len(piece))
        self.scanned += piece
        if not self.quoted and piece:
            self.out.append(Args(self.calls - 1, piece))
        if end < 0:
            return False
        if self.quoted:
            self.out.append(Args(self.calls - 1, json.loads(self.scanned)))
        self.state = SECTION if self.named else TAIL
        if self.named:
            self.out.append(End(self.calls - 1))
        return True

    def _tail(self, final: bool) -> bool:
        """The rest of the call's object (other keys, such as Mistral's `id`) to its `}`."""
        end = value_end(self.buf, depth=1)
        if end < 0:
            return False
        self._eat(end)
        self.out.append(End(self.calls - 1))
        self.state = SECTION
        return True

    def _close(self) -> bool:
        if not self.in_section:
            return self._fail()
        self.state, self.lead, self.raw = TEXT, True, ""
        return True

    def _fail(self) -> bool:
        """The section holds text that is no call: back to the content."""
        if self.in_section:  # after its calls: the section just ends
            self.state, self.lead, self.raw = TEXT, True, ""
            return True
        self._give_back()
        return True

    def _give_back(self) -> None:
        """The open section's text, back to the content as written (none once it held a call)."""
        text = "" if self.in_section else self.dropped + self.raw
        self.dropped, self.raw, self.state = "", "", TEXT
        if text:
            self.ws = ""
            self._content(text, force=True)
        self.seen = True  # a `{` start that held no call is content: no second try

    def _eat(self, n: int) -> None:
        self.raw += self.buf[:n]
        self.buf = self.buf[n:]

    def _content(self, text: str, force: bool = False) -> None:
        if self.lead:
            text = text.lstrip()
            if not text:
                return
            self.lead = False
        body = self.ws + text
        kept = body if force else body.rstrip()
        if kept:
            self.out.append(Content(kept))
            self.seen = self.seen or bool(kept.strip())
        self.ws = body[len(kept) :]


def _named_prefix(text: str) -> bool:
    """Whether `text` may still grow into `NAME[ARGS]` or `NAME[CALL_ID]ID[ARGS]`."""
    rest = text[_WORD.match(text).end() :]  # type: ignore[union-attr]
    if "[ARGS]".startswith(rest) or "[CALL_ID]".startswith(rest):
        return True
    if not rest.startswith("[CALL_ID]"):
        return False
    rest = rest[len("[CALL_ID]") :]
    return "[ARGS]".startswith(rest[_WORD.match(rest).end() :])  # type: ignore[union-attr]


def _partial(text: str, openers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper beginning of an opener."""
    for k in range(min(len(text), max((len(o) for o in openers), default=1) - 1), 0, -1):
        if any(o.startswith(text[-k:]) for o in openers):
            return k
    return 0
