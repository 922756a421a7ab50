"""Ollama's request bodies and `options`, mapped onto tandem's `SamplingParams`.

    option             -> tandem                          Ollama's default (used when absent)
    temperature        temperature                        0.8
    top_k              top_k (0: off)                     40
    top_p              top_p                              0.9
    min_p              min_p                              0.0
    seed               seed (-1: random)                  random
    num_predict        max_tokens (-1, -2: to the context) -1
    stop               stop strings
    repeat_penalty     repetition_penalty                 1.1
    repeat_last_n      repetition_window (-1: all, 0: no repetition penalty)   64
    presence_penalty   presence_penalty (over the output, as OpenAI's)          0.0
    frequency_penalty  frequency_penalty (over the output, as OpenAI's)         0.0
    num_ctx            prompt + output bounded by min(num_ctx, the server's context)

Options that only steer loading or threads (num_gpu, num_thread, use_mmap, ...) change nothing
tandem generates and are accepted; options for samplers tandem does not have (mirostat, tfs_z,
typical_p) are a 400 naming them unless given their off value, and so is any option or field
Ollama does not define. `format` ("json" or a JSON schema) constrains the output (`structured.py`);
chat's `tools` are offered to the model and its `<tool_call>` blocks returned as `tool_calls`;
`think` (true, false, or a level "low" / "medium" / "high") is read by `ollama.py` (false: no
`thinking` in the answer); a message's `thinking` goes back to the template as its reasoning;
`images` and generate's `tools` are refused until tandem honours them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.sampling_params import SamplingParams, SamplingParamsError
from tandem.server.protocol import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, APIError

DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.1,
    "repeat_last_n": 64,
}
NO_EFFECT_OPTIONS = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",  # what a truncated prompt keeps: tandem never truncates (a 400 instead)
    }
)
OFF_VALUE_OPTIONS: dict[str, Callable[[Any], bool]] = {
    "mirostat": lambda v: v in (None, 0),
    "mirostat_tau": lambda v: True,  # read only by mirostat
    "mirostat_eta": lambda v: True,
    "tfs_z": lambda v: v in (None, 1, 1.0),
    "typical_p": lambda v: v in (None, 1, 1.0),
    "penalize_newline": lambda v: not v,
}
SAMPLING_OPTIONS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "num_predict",
        "stop",
        "repeat_penalty",
        "repeat_last_n",
        "presence_penalty",
        "frequency_penalty",
        "num_ctx",
    }
)
# Request fields tandem does not honour: refused unless given the value that asks for nothing.
NOT_HONOURED: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: not v,
    "images": lambda v: not v,
    "suffix": lambda v: not v,
    "template": lambda v: not v,
}
ACCEPTED = frozenset({"keep_alive"})  # when to unload the model: tandem keeps it loaded
MESSAGE_NOT_HONOURED = ("images",)
# a call the model made, a tool's result, an assistant turn's reasoning
MESSAGE_PASSED = ("tool_calls", "tool_name", "thinking")
REASONING_KEYS = ("reasoning_content", "thinking")  # as templates read it (Qwen3's, gpt-oss's)


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        extra = self.model_extra or {}
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        for name in extra:
            if name in MESSAGE_PASSED and extra[name]:
                out.update(_passed(index, name, extra[name]))
                continue
            if name not in (*MESSAGE_NOT_HONOURED, *MESSAGE_PASSED):
                raise APIError(400, f"messages[{index}].{name} is not a field tandem knows")
            if extra[name]:
                raise APIError(400, f"messages[{index}].{name} is not supported by tandem")
        return out


def _passed(index: int, name: str, value: Any) -> dict[str, Any]:
    """Ollama's `tool_calls` ([{"function": {"name", "arguments": {...}}}]) as OpenAI's,
    `tool_name` as the message's `name`, `thinking` under both names templates read."""
    if name == "tool_name":
        return {"name": str(value)}
    if name == "thinking":
        if not isinstance(value, str):
            raise APIError(400, f"messages[{index}].thinking must be a string")
        return dict.fromkeys(REASONING_KEYS, value)
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise APIError(400, f"messages[{index}].tool_calls must be a list of calls")
    return {
        "tool_calls": [{"type": "function", "function": c.get("function") or {}} for c in value]
    }


class _OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: bool = True
    options: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema
    think: bool | Literal["low", "medium", "high"] | None = None  # None: the model's default

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in ACCEPTED:
                continue
            harmless = NOT_HONOURED.get(name)
            if harmless is None:
                raise APIError(400, f"`{name}` is not a field tandem knows", param=name)
            if not harmless(value):
                raise APIError(400, f"`{name}` is not supported by tandem yet", param=name)

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class OllamaChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # function tools, chosen by the model (`tools.py`)


class OllamaGenerateRequest(_OllamaRequest):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None


def sampling_params(
    body: _OllamaRequest, prompt_tokens: int, max_seq_len: int
) -> tuple[SamplingParams, tuple[str, ...]]:
    """The request's `options` as SamplingParams (Ollama's defaults where absent) and its stop
    strings; a 400 naming `options.<name>` for a value out of range or an option not honoured."""
    options = dict(body.options or {})
    for name, value in options.items():
        if name in SAMPLING_OPTIONS or name in NO_EFFECT_OPTIONS:
            continue
        harmless = OFF_VALUE_OPTIONS.get(name)
        if harmless is None:
            raise APIError(400, f"options.{name} is not an option tandem knows", param="options")
        if not harmless(value):
            raise APIError(400, f"options.{name} is not supported by tandem", param="options")
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    try:
        context = _context(o.get("num_ctx"), max_seq_len)
        if prompt_tokens >= context:
            raise APIError(
                400,
                f"the prompt has {prompt_tokens} tokens; the context is {context} "
                f"(num_ctx, at most this server's {max_seq_len})",
                param="options",
            )
        predict = int(o.get("num_predict", -1))
        if predict == 0 or predict < -2:
            raise APIError(400, f"options.num_predict must be > 0, -1 or -2, got {predict}")
        room = context - prompt_tokens
        window = int(o["repeat_last_n"])
        repeat = float(o["repeat_penalty"]) if window != 0 else 1.0
        seed = o.get("seed")
        params = SamplingParams(
            max_tokens=min(predict, room) if predict > 0 else room,
            temperature=float(o["temperature"]),
            top_p=float(o["top_p"]),
            top_k=int(o["top_k"]),
            min_p=float(o["min_p"]),
            seed=None if seed is None or seed == -1 else int(seed),
            repetition_penalty=repeat,
            repetition_window=0 if window < 0 else window,
            presence_penalty=float(o.get("presence_penalty", 0.0)),
            frequency_penalty=float(o.get("frequency_penalty", 0.0)),
            logprobs=body.logprobs_wanted(),
        )
    except (SamplingParamsError, TypeError, ValueError) as e:
        raise APIError(400, f"options: {e}", param="options") from e
    return params, _stop_strings(o.get("stop"))


def _context(num_ctx: Any, max_seq_len: int) -> int:
    if num_ctx is None:
        return max_seq_len
    n = int(num_ctx)
    if n < 1:
        raise APIError(400, f"options.num_ctx must be >= 1, got {n}", param="options")
    return min(n, max_seq_len)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in items):
        raise APIError(400, "options.stop must be strings", param="options")
    if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in items):
        raise APIError(
            400,
            f"options.stop: at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters",
            param="options",
        )
    return tuple(items)
