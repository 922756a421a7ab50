"""OpenAI request bodies (the fields tandem honours) and OpenAI-style error bodies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

# The ranges OpenAI documents (top_k -1: off, as vLLM takes it); refused here with a 400 naming
# the field, before anything reaches the scheduler.
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=(1 << 31) - 1)]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]  # torch's Generator range
TokenCount = Annotated[int, Field(le=(1 << 31) - 1)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)]
BiasValue = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
MAX_LOGPROBS = 20  # chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


class APIError(Exception):
    """An error the API returns as `{"error": {...}}` with an HTTP status, like OpenAI's."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# the routes behind the API key: OpenAI's, Ollama's and llama.cpp's native ones
KEYED = ("/v1", "/api/", "/completion", "/tokenize", "/detokenize")
OPEN = frozenset({"/api/version"})  # as /health: apps probe it to find an Ollama API


def keyed(path: str) -> bool:
    """Whether `path` needs the API key (when the server has one)."""
    return path.startswith(KEYED) and path not in OPEN


def error_response(path: str, err: APIError) -> JSONResponse:
    """OpenAI's `{"error": {...}}` body, or Ollama's `{"error": "..."}` under /api/."""
    if path.startswith("/api/"):
        return JSONResponse({"error": err.message}, status_code=err.status)
    return JSONResponse(err.body(), status_code=err.status)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a subfield tandem does not know: a 400

    include_usage: bool = False
    include_obfuscation: bool | None = None  # tandem never pads its chunks: either value holds


# Fields OpenAI defines that change nothing tandem computes (ids, tags, routing and cache hints):
# accepted and not used.
METADATA_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)
# Fields tandem does not honour: a 400 naming the field, unless it is given the value that asks for
# nothing (what OpenAI does without it).
NOT_HONOURED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "echo": lambda v: not v,
    "suffix": lambda v: not v,
}
# Per message: fields a template does not get from tandem yet.
MESSAGE_NOT_HONOURED: dict[str, Callable[[Any], bool]] = {
    "function_call": lambda v: v is None,
    "audio": lambda v: v is None,
}
MESSAGE_PASSED = ("name", "tool_call_id")  # handed to the chat template with role and content
# an assistant turn's reasoning, as templates read it: Qwen3's `reasoning_content`, gpt-oss's
# `thinking`
REASONING_KEYS = ("reasoning_content", "thinking")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# template variables a request's `chat_template_kwargs` may not set: tandem sets them
RESERVED_TEMPLATE_VARIABLES = frozenset({"tools", "messages", "add_generation_prompt"})
MAX_LOGIT_BIAS = 300  # OpenAI's bound on the map's size
MAX_N = 8


class _Sampling(BaseModel):
    # every field OpenAI defines is named here or in METADATA_FIELDS / NOT_HONOURED; anything else
    # is kept in model_extra and refused (`refuse_unsupported`), never silently ignored
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # vLLM's extension
    min_p: MinP | None = None  # vLLM's extension
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM's extension
    logit_bias: dict[str, BiasValue] | None = None
    ignore_eos: bool = False  # vLLM's extension: always generate max_tokens
    response_format: dict[str, Any] | None = None  # structured output (`structured.py`)
    grammar: str | None = None  # llama.cpp's: a GBNF grammar (`structured.py`)
    guided_grammar: str | None = None  # vLLM's older name for it
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"grammar": GBNF}

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
        if any(len(x) > MAX_STOP_CHARS for x in items):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
        for key in v:
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise ValueError(f"keys are token ids (non-negative integers), got {key!r}")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs, one per id (the last of keys naming the same)."""
        merged = {int(k): float(b) for k, b in (self.logit_bias or {}).items()}
        return tuple(sorted(merged.items()))

    def logprobs_wanted(self) -> int | None:
        """How many top tokens to report beside the chosen one; None: no logprobs."""
        return None

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field tandem does not honour (or does not know)."""
        for name, value in (self.model_extra or {}).items():
            if name in METADATA_FIELDS:
                continue
            harmless = NOT_HONOURED.get(name)
            if harmless is None:
                raise APIError(400, f"`{name}` is not a field tandem knows", param=name)
            if not harmless(value):
                raise APIError(
                    400, f"`{name}` is not supported by tandem (given {_short(value)})", param=name
                )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            for part in self.content:
                if part.get("type") != "text":
                    raise APIError(
                        400,
                        f"messages[{index}]: content parts of type {part.get('type')!r} are not "
                        "supported (text only)",
                        param="messages",
                    )
            return "".join(str(p.get("text", "")) for p in self.content)
        return self.content or ""

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template reads it: role, content and the fields it may use; a
        400 for a field it would not see."""
        extra = self.model_extra or {}
        for name, harmless in MESSAGE_NOT_HONOURED.items():
            if name in extra and not harmless(extra[name]):
                raise APIError(
                    400, f"messages[{index}].{name} is not supported by tandem", param="messages"
                )
        out: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        for name in MESSAGE_PASSED:
            if isinstance(extra.get(name), str):
                out[name] = extra[name]
        if isinstance(extra.get("reasoning_content"), str):
            out.update(dict.fromkeys(REASONING_KEYS, extra["reasoning_content"]))
        calls = extra.get("tool_calls")
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise APIError(
                    400, f"messages[{index}].tool_calls must be a list of calls", param="messages"
                )
            out["tool_calls"] = calls
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None  # function tools (`tools.py`)
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required or {function: {name}}
    parallel_tool_calls: bool | None = None  # the calls a model writes are all returned
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # for a chat template that reads it (gpt-oss's); refused for one that does not
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}

    def template_variables(self, reads: Callable[[str], bool]) -> dict[str, Any]:
        """The chat template's variables this request sets (`reads(name)`: whether the template
        names it); a 400 for `reasoning_effort` where the template has no use for it, or a
        `chat_template_kwargs` key tandem sets itself."""
        out = dict(self.chat_template_kwargs or {})
        taken = RESERVED_TEMPLATE_VARIABLES & set(out)
        if taken:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(sorted(taken))}",
                param="chat_template_kwargs",
            )
        if self.reasoning_effort is not None:
            if not reads("reasoning_effort"):
                raise APIError(
                    400,
                    "`reasoning_effort` is not supported by this model's chat template",
                    param="reasoning_effort",
                )
            out["reasoning_effort"] = self.reasoning_effort
        return out

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(
                400, "`best_of` is not supported by tandem (only best_of = n)", param="best_of"
            )

    def prompt_text_or_ids(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list):
            if p and all(isinstance(x, int) for x in p):
                return list(p)  # type: ignore[arg-type]
            if len(p) != 1:
                raise APIError(400, "exactly one prompt per request is supported", param="prompt")
            return str(p[0])
        return p
