"""OpenAI request bodies (the fields tandem honours) and OpenAI-style error bodies."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The ranges OpenAI documents (top_k -1: off, as vLLM takes it); refused here with a 400 naming
# the field, before anything reaches the scheduler.
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=(1 << 31) - 1)]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]  # torch's Generator range
TokenCount = Annotated[int, Field(le=(1 << 31) - 1)]
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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    # extra fields (frequency_penalty, logprobs, user, ...) are accepted and ignored, as vLLM does
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension: always generate max_tokens

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
        if any(len(x) > MAX_STOP_CHARS for x in items):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]

    def prompt_text_or_ids(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list):
            if p and all(isinstance(x, int) for x in p):
                return list(p)  # type: ignore[arg-type]
            if len(p) != 1:
                raise APIError(400, "exactly one prompt per request is supported", param="prompt")
            return str(p[0])
        return p
