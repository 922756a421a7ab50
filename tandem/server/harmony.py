"""gpt-oss's harmony format, parsed as it streams: each assistant message is a header and a body,

    <|start|>assistant<|channel|>analysis<|message|>...<|end|>          reasoning
    <|start|>assistant<|channel|>final<|message|>...<|return|>          content
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
                                                                         a call of NAME
    <|start|>assistant<|channel|>commentary<|message|>...<|end|>        content (a preamble)

The recipient (`to=...`) may stand in the role's part of the header too (`<|start|>assistant
to=functions.NAME<|channel|>commentary json<|message|>`). A header is held until its
`<|message|>` says where the body goes; a call's body is held until the call ends, and becomes
a `ToolCall` when it is a JSON object (else its text goes where its channel's would). Text outside any message
(a model that does not keep the format) is content, and so is a header the output ends in
that holds no marker. `<|return|>` and `<|call|>` end a generation and are usually stop tokens:
the end of the output ends the message it is in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from tandem.server.reasoning import Marker, Parsed, Piece, ToolCall

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=(\S+)")

OUTSIDE, HEADER, BODY = "outside", "header", "body"


class HarmonyParser:
    """The harmony messages of an output (see the module's docstring); `prime` it with the
    prompt's last pieces (`<|start|>assistant`) so the output starts in their header."""

    def __init__(self) -> None:
        self.state = OUTSIDE
        self.header: list[Piece] = []
        self.own = 0  # header[own:] came from the output, not from `prime`
        self.route = "content"  # where the body's text goes: "reasoning" or "content"
        self.name = ""  # the function the body calls ("": none)
        self.args: list[str] = []  # a call's body, held until the call ends

    def prime(self, pieces: Iterable[Piece]) -> None:
        """Feeds the prompt's pieces that the output continues, showing nothing of them."""
        self.feed(pieces)
        self.own = len(self.header)

    def feed(self, pieces: Iterable[Piece]) -> Parsed:
        out = Parsed()
        for p in pieces:
            if isinstance(p, str):
                self._text(p, out)
            elif p.text == START or (p.text == CHANNEL and self.state != HEADER):
                self._end_message(out)
                self.state, self.header, self.own = HEADER, [p], 0
            elif p.text in (CHANNEL, CONSTRAIN) and self.state == HEADER:
                self.header.append(p)
            elif p.text == MESSAGE and self.state != BODY:
                self._open_body()
            elif p.text in (END, RETURN, CALL):
                self._end_message(out)
                self.state, self.header = OUTSIDE, []
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self.state == HEADER:  # a header never closed: content if it is not one at all
            own = self.header[self.own :]
            if not any(isinstance(p, Marker) for p in own):
                out.content += "".join(own)  # type: ignore[arg-type]
        self._end_message(out)
        self.state, self.header = OUTSIDE, []
        return out

    def _text(self, text: str, out: Parsed) -> None:
        if self.state == HEADER:
            self.header.append(text)
        elif self.state == OUTSIDE:
            out.content += text
        elif self.name:
            self.args.append(text)
        elif self.route == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _open_body(self) -> None:
        text = "".join(p.text if isinstance(p, Marker) else p for p in self.header)
        after = text.split(CHANNEL, 1)[1] if CHANNEL in text else ""
        words = after.replace(CONSTRAIN, " ").split()
        channel = words[0] if words else ""
        recipient = _RECIPIENT.search(text.replace(CHANNEL, " ").replace(CONSTRAIN, " "))
        self.name = recipient.group(1).removeprefix(FUNCTIONS) if recipient else ""
        self.route = "reasoning" if channel == "analysis" else "content"
        self.state, self.header, self.args = BODY, [], []

    def _end_message(self, out: Parsed) -> None:
        if self.state == BODY and self.name:
            text = "".join(self.args)
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if isinstance(value, dict):
                out.calls.append(ToolCall(self.name, json.dumps(value)))
            elif self.route == "reasoning":
                out.reasoning += text
            else:
                out.content += text
        self.args, self.name = [], ""
        if self.state == BODY:
            self.state = OUTSIDE
