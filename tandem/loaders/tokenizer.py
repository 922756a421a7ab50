"""`tokenizer.json` through the `tokenizers` library, and the chat template from
`tokenizer_config.json` rendered by a sandboxed jinja2 in its own bounded process (templates are
data from the model directory: no access to Python objects, and a time, output and memory bound,
`tandem.loaders.chat_template`). A GGUF file's tokenizer arrives in the same type
(`tandem.loaders.gguf.tokenizer.load_gguf_tokenizer`), its metadata in the same config keys."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tandem.loaders.chat_template import TemplateLimits, TemplateRenderer
from tandem.loaders.errors import (
    ChatTemplateError,
    ChatTemplateRefused,
    CorruptFileError,
    TemplateLimitError,
)

__all__ = ["ChatTemplateError", "StreamDecoder", "TemplateLimitError", "Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"  # its eos_token_id: every id that ends a turn
PROBE_MESSAGES = [{"role": "user", "content": "Hello!"}]


class Tokenizer:
    """A `tokenizers` tokenizer plus what a prompt needs from the model's tokenizer config:
    `bos_token` / `eos_token` (texts), `add_bos_token` / `add_eos_token`, `chat_template`.

    `eos_token_ids` are the ids generation stops on: the EOS token's by default, or the list the
    source gives (a GGUF's EOS plus its end-of-turn tokens). `template_origin` names where the chat
    template came from, for error messages; `template_limits` bound each render of it."""

    def __init__(
        self,
        tok: HFTokenizer,
        config: dict[str, Any],
        source: Path,
        *,
        eos_token_ids: Sequence[int] | None = None,
        template_origin: str | None = None,
    ) -> None:
        self._tok = tok
        self.config = config
        self.source = source
        self.template_origin = template_origin or str(source / TOKENIZER_CONFIG_FILE)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = config.get("add_bos_token") is True and self.bos_token_id is not None
        self.add_eos_token = config.get("add_eos_token") is True and self.eos_token_id is not None
        if eos_token_ids is None:
            eos_token_ids = () if self.eos_token_id is None else (self.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self._pieces: _PieceRules | None = None  # read from the decoder on first use
        self.template_limits = TemplateLimits()
        self._renderer: TemplateRenderer | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The directory's tokenizer, or None when it has no `tokenizer.json` (prompts must then be
        given as token ids). Generation stops on the EOS token and on the ids
        `generation_config.json` lists as `eos_token_id`, as transformers' generate does (gpt-oss
        ends a tool call with `<|call|>`, named only there)."""
        path = Path(path)
        file = path / TOKENIZER_FILE
        if not file.exists():
            return None
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises a bare Exception on malformed files
            raise CorruptFileError(f"{file}: not a valid tokenizer ({e})") from e
        config = _json_object(path / TOKENIZER_CONFIG_FILE)
        made = cls(tok, config, path)
        listed = _json_object(path / GENERATION_CONFIG_FILE).get("eos_token_id")
        listed = listed if isinstance(listed, list) else [listed]
        more = [i for i in listed if type(i) is int and 0 <= i < made.vocab_size]
        made.eos_token_ids = tuple(dict.fromkeys([*made.eos_token_ids, *more]))
        return made

    def encode(self, text: str) -> list[int]:
        """The text's ids, special tokens written in it matched whole; nothing added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The ids a generation starts from: `encode(text)`, with BOS in front when the model asks
        for it (`add_bos_token`) and EOS at the end when it asks for that (`add_eos_token`), each
        only if the text does not already have it there. A chat template that writes `bos_token`
        itself so gets one BOS, as in llama.cpp (which strips the template's and adds its own)."""
        ids = self.encode(text)
        if self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        if self.add_eos_token and ids[-1:] != [self.eos_token_id]:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (what logprobs report: a token may hold part of a UTF-8
        character): a byte-level BPE piece through GPT-2's byte table, a SentencePiece byte
        fallback `<0xNN>` as its byte and its `▁` as a space, an added token as its text; b""
        for an id the vocabulary does not have."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._pieces is None:
            self._pieces = _PieceRules.of(self._tok)
        return self._pieces.bytes_of(token_id, piece)

    def token_id(self, text: str) -> int | None:
        """The id of the one token whose text is exactly `text` (a marker such as `<think>`),
        or None where the vocabulary has no such token."""
        found = self._tok.token_to_id(text)
        if found is None or self._tok.decode([found], skip_special_tokens=False) != text:
            return None
        return found

    @property
    def special_token_ids(self) -> list[int]:
        """The ids of the added tokens marked special (no text encodes to them)."""
        added = self._tok.get_added_tokens_decoder()
        return sorted(i for i, t in added.items() if t.special)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.config.get("chat_template"))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}]) into the prompt text, in the
        template's bounded process: `TemplateLimitError` past a bound, `ChatTemplateRefused`
        where the template refuses the messages, `ChatTemplateError` otherwise."""
        return self._template().render(messages, add_generation_prompt, extra)

    def check_chat_template(self) -> None:
        """A probe render of one user message, for load time: a template that goes past its
        limits on it (or does not compile) raises here, before anything is served; one that
        refuses the probe's messages is left to the requests."""
        if not self.has_chat_template:
            return
        try:
            self.apply_chat_template(PROBE_MESSAGES)
        except ChatTemplateRefused:
            pass

    def close(self) -> None:
        """Ends the template's process (it also ends with this object, or with the parent)."""
        if self._renderer is not None:
            self._renderer.close()

    def _template(self) -> TemplateRenderer:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template:
            raise ChatTemplateError(f"{self.template_origin}: no chat template")
        r = self._renderer
        if r is None or r.template != template or r.limits != self.template_limits:
            if r is not None:
                r.close()
            tokens = {
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
                "unk_token": _token_text(self.config.get("unk_token")) or "",
                "pad_token": _token_text(self.config.get("pad_token")) or "",
            }
            r = TemplateRenderer(template, tokens, self.template_origin, self.template_limits)
            self._renderer = r
        return r


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


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class _PieceRules:
    """How a vocabulary piece maps to bytes, read from the tokenizer's decoder once."""

    def __init__(self, byte_level: bool, byte_fallback: bool, added: set[int]) -> None:
        self.byte_level = byte_level
        self.byte_fallback = byte_fallback
        self.added = added
        self.table = _gpt2_byte_table() if byte_level else {}

    @classmethod
    def of(cls, tok: HFTokenizer) -> _PieceRules:
        decoder = tok.decoder
        kinds = json.dumps(json.loads(decoder.__getstate__())) if decoder is not None else ""
        return cls(
            '"ByteLevel"' in kinds,
            '"ByteFallback"' in kinds,
            set(tok.get_added_tokens_decoder()),
        )

    def bytes_of(self, token_id: int, piece: str) -> bytes:
        if token_id in self.added:
            return piece.encode()
        if self.byte_level:
            return b"".join(
                bytes([self.table[c]]) if c in self.table else c.encode() for c in piece
            )
        m = _BYTE_FALLBACK.fullmatch(piece)
        if self.byte_fallback and m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


def _json_object(file: Path) -> dict[str, Any]:
    """A small config file's JSON object ({} where there is no file)."""
    if not file.exists():
        return {}
    try:
        value = json.loads(file.read_text())
        if not isinstance(value, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError) as e:  # deep nesting: RecursionError
        raise CorruptFileError(f"{file}: not a JSON object ({e})") from e
    return value


def _token_text(t: Any) -> str | None:
    if isinstance(t, dict):  # AddedToken serialised form
        t = t.get("content")
    return t if isinstance(t, str) else None
