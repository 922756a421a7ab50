"""gpt-oss's tool calls, harmony `commentary` messages addressed to a function,

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

read with the reasoning by `tandem.server.harmony` and forced by
`tandem.server.reasoning_grammar.harmony_call` (after an optional analysis). Where the prompt
does not leave the output in an assistant header, a forced call falls back to a Hermes block,
and Hermes blocks in the content are read as calls."""

from __future__ import annotations

from tandem.server.tool_formats import ToolFormat, hermes

FORMAT = ToolFormat("harmony", hermes.FORMAT.syntax, hermes.grammar)
