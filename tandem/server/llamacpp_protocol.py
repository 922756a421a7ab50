"""llama.cpp's native `/completion` body (the fields its server documents that tandem honours),
mapped onto tandem's `SamplingParams`, with llama.cpp's defaults where a field is absent.

    field              -> tandem                                  llama.cpp's default
    prompt             a string (BOS added as the model asks) or token ids, taken as they are
    n_predict          max_tokens (-1: to the context's end)      -1
    temperature        temperature (<= 0: greedy)                 0.8
    top_k              top_k (<= 0: off)                          40
    top_p              top_p (1: off)                             0.95
    min_p              min_p (0: off)                             0.05
    seed               seed (-1 or 0xFFFFFFFF: random)            -1
    stop               stop strings                               []
    repeat_penalty     repetition_penalty                         1.0 (common.h; the README says 1.1)
    repeat_last_n      repetition_window (-1: all, 0: off)         64
    presence_penalty, frequency_penalty  as OpenAI's              0.0
    logit_bias         [[id, bias], ...] or {"id": bias}, bias in [-100, 100] (added to the
                       logit, as OpenAI's) or `false` (the token never drawn: -inf, as
                       llama.cpp); an id given as text biases each token of the text (tokenized
                       without special tokens, as llama.cpp); `true`, which llama.cpp skips, and
                       an id outside the vocabulary, which it drops, are a 400
    model              ignored, as llama-server ignores it (the answer names the served model)
    ignore_eos, stream, grammar (GBNF), json_schema, n_probs (top logprobs per token),
    cache_prompt (false: the whole prompt is prefilled), return_tokens

Samplers tandem does not have (typical_p, mirostat, DRY, XTC, dynamic temperature), and fields
that would change what a request does without tandem doing it (n_keep, lora, ...), are a 400
naming them unless given their off value; any other field llama.cpp does not define is a 400 too.
`n_predict: 0` (llama.cpp: prefill only) is a 400: tandem always generates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.sampling_params import SamplingParams, SamplingParamsError
from tandem.server.protocol import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    APIError,
)

RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # LLAMA_DEFAULT_SEED
# Fields llama.cpp defines for what tandem does not do: refused unless given their off value.
OFF_VALUES: dict[str, Callable[[Any], bool]] = {
    "typical_p": lambda v: v in (None, 1, 1.0),
    "mirostat": lambda v: v in (None, 0),
    "mirostat_tau": lambda v: True,  # read only by mirostat
    "mirostat_eta": lambda v: True,
    "dynatemp_range": lambda v: v in (None, 0, 0.0),
    "dynatemp_exponent": lambda v: True,  # read only with a range
    "dry_multiplier": lambda v: v in (None, 0, 0.0),
    "dry_base": lambda v: True,  # read only by DRY
    "dry_allowed_length": lambda v: True,
    "dry_penalty_last_n": lambda v: True,
    "dry_sequence_breakers": lambda v: True,
    "xtc_probability": lambda v: v in (None, 0, 0.0),
    "xtc_threshold": lambda v: True,  # read only by XTC
    "n_keep": lambda v: v in (None, 0),  # what a truncated prompt keeps: tandem never truncates
    "n_indent": lambda v: v in (None, 0),
    "n_cmpl": lambda v: v in (None, 1),
    "n_cache_reuse": lambda v: v in (None, 0),
    "min_keep": lambda v: v in (None, 0),
    "t_max_predict_ms": lambda v: v in (None, 0),
    "id_slot": lambda v: v in (None, -1),
    "post_sampling_probs": lambda v: not v,
    "lora": lambda v: not v,
    "samplers": lambda v: v is None,
    "response_fields": lambda v: not v,
    "return_progress": lambda v: not v,
    "timings_per_token": lambda v: not v,
    "image_data": lambda v: not v,
}
ACCEPTED = frozenset({"sse_ping_interval"})  # keep-alive pings: tandem's stream needs none


class LlamaCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt: str | list[int | str]
    model: str | None = None
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    stop: str | list[str] | None = None
    stream: bool = False
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    cache_prompt: bool = True
    n_probs: int = Field(default=0, ge=0, le=MAX_LOGPROBS)
    return_tokens: bool = False

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field tandem does not honour (or llama.cpp does not define)."""
        for name, value in (self.model_extra or {}).items():
            if name in ACCEPTED:
                continue
            harmless = OFF_VALUES.get(name)
            if harmless is None:
                raise APIError(400, f"`{name}` is not a field tandem knows", param=name)
            if not harmless(value):
                raise APIError(
                    400, f"`{name}` is not supported by tandem (given {value!r})", param=name
                )

    def prompt_text_or_ids(self) -> str | list[int]:
        """The prompt: one string, or token ids; a 400 for several prompts or a mixed list."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(x, int) for x in p):
            return [int(x) for x in p]
        raise APIError(
            400, "one prompt per request: a string or a list of token ids", param="prompt"
        )

    def stop_strings(self) -> tuple[str, ...]:
        items = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in items):
            raise APIError(
                400,
                f"stop: at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters",
                param="stop",
            )
        return tuple(items)

    def sampling_params(
        self, prompt_tokens: int, max_seq_len: int, encode: Callable[[str], list[int]]
    ) -> SamplingParams:
        """The request as SamplingParams (`encode`: text to token ids without special tokens, for
        `logit_bias`'s text ids); a 400 naming the field for a value out of range."""
        if prompt_tokens >= max_seq_len:
            raise APIError(
                400,
                f"the prompt has {prompt_tokens} tokens; the context is {max_seq_len}",
                param="prompt",
            )
        room = max_seq_len - prompt_tokens
        if self.n_predict == 0 or self.n_predict < -1:
            raise APIError(
                400,
                f"n_predict must be -1 or >= 1 (tandem always generates), got {self.n_predict}",
                param="n_predict",
            )
        window = self.repeat_last_n
        if window < -1:
            raise APIError(400, f"repeat_last_n must be >= -1, got {window}", param="repeat_last_n")
        try:
            return SamplingParams(
                max_tokens=min(self.n_predict, room) if self.n_predict > 0 else room,
                temperature=max(self.temperature, 0.0),
                top_p=self.top_p,
                top_k=max(self.top_k, 0),
                min_p=self.min_p,
                seed=None if self.seed in RANDOM_SEEDS else self.seed,
                ignore_eos=self.ignore_eos,
                repetition_penalty=self.repeat_penalty if window != 0 else 1.0,
                repetition_window=0 if window < 0 else window,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                logprobs=self.n_probs or None,
                logit_bias=self.bias_pairs(encode),
            )
        except SamplingParamsError as e:
            field = str(e).split(" ", 1)[0]
            names = {"repetition_penalty": "repeat_penalty", "max_tokens": "n_predict"}
            raise APIError(400, str(e), param=names.get(field, field)) from e

    def bias_pairs(self, encode: Callable[[str], list[int]]) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (id, bias) pairs, a later entry for an id replacing an earlier: a
        number is added to the logit, `false` bans the token (-inf); a text id (not digits) is
        `encode`d and each of its tokens takes the bias. A 400 for anything else."""
        v = self.logit_bias
        items = list(v.items()) if isinstance(v, dict) else [tuple(x) for x in v or []]
        if len(items) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias: at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
        out: dict[int, float] = {}
        for item in items:
            token, bias = item if len(item) == 2 else (None, None)
            if bias is False:
                bias = -math.inf
            if isinstance(token, str) and token.isascii() and token.isdigit():
                token = int(token)
            ids = encode(token) if isinstance(token, str) and token else [token]
            if not all(isinstance(t, int) for t in ids) or not _a_bias(bias):
                raise APIError(
                    400,
                    f"logit_bias entries are [token id or text, bias] with a number in "
                    f"[-100, 100] or false, got {list(item)!r}",
                    param="logit_bias",
                )
            out.update((t, float(bias)) for t in ids)
        if len(out) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias: at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
        return tuple(out.items())

    def settings(self) -> dict[str, Any]:
        """The `generation_settings` llama.cpp echoes: the fields as this request set them."""
        keep = ("n_predict", "temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty")
        keep += ("repeat_last_n", "presence_penalty", "frequency_penalty", "ignore_eos", "n_probs")
        out = {k: getattr(self, k) for k in keep}
        out.update(stop=list(self.stop_strings()), stream=self.stream)
        return out


def _a_bias(b: Any) -> bool:
    """A number (not a bool: `true` has no meaning in llama.cpp, which skips it) or -inf."""
    return (isinstance(b, (int, float)) and not isinstance(b, bool)) or b == -math.inf


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[int]
