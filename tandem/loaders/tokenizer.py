"""`tokenizer.json` through the `tokenizers` library, and the chat template from
`tokenizer_config.json` rendered with a sandboxed jinja2 (templates are data from the model
directory, so they get no access to Python objects)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from tandem.loaders.safetensors_dir import CorruptFileError, ModelFileError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(ModelFileError):
    """The model has no chat template, or the template failed to render."""


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict[str, Any], source: Path) -> None:
        self._tok = tok
        self.config = config
        self.source = source
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        eos_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: tuple[int, ...] = (eos_id,) if eos_id is not None else ()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The directory's tokenizer, or None when it has no `tokenizer.json` (prompts must then be
        given as token ids)."""
        path = Path(path)
        file = path / TOKENIZER_FILE
        if not file.exists():
            return None
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises a bare Exception on malformed files
            raise CorruptFileError(f"{file}: not a valid tokenizer ({e})") from e
        config: dict[str, Any] = {}
        cfg_file = path / TOKENIZER_CONFIG_FILE
        if cfg_file.exists():
            try:
                config = json.loads(cfg_file.read_text())
                if not isinstance(config, dict):
                    raise ValueError("not an object")
            except (ValueError, RecursionError) as e:  # deep nesting: RecursionError
                raise CorruptFileError(f"{cfg_file}: not a JSON object ({e})") from e
        return cls(tok, config, path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.config.get("chat_template"))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}]) into the prompt text."""
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template:
            raise ChatTemplateError(f"{self.source / TOKENIZER_CONFIG_FILE}: no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent
        )

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"chat template refused the messages: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(
                f"{self.source / TOKENIZER_CONFIG_FILE}: chat template failed: {e}"
            ) from e


class StreamDecoder:
    """Turns a stream of token ids into text increments, holding back bytes of an unfinished UTF-8
    character (a byte-level BPE token may end mid-character)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[len(self.emitted) :], text
        return new


def _token_text(t: Any) -> str | None:
    if isinstance(t, dict):  # AddedToken serialised form
        t = t.get("content")
    return t if isinstance(t, str) else None
