"""The built-in model's corpus and tokenizer: CPython's reference text, split and tokenized.

The corpus is `pydoc_data.topics` (the Python Language Reference and Library Reference sections that
`help()` shows; PSF licence), which ships with every CPython, so training needs no network.

Split, deterministic and leak-free:
  1. every topic is cut into sections at its reST headings (a title line underlined by `*`, `=` or
     `-`); the underline is dropped, so a section repeated under another topic with a different
     underline character is recognized as the same section;
  2. exact duplicate sections (same heading, same body) are kept once, in sorted-topic order;
  3. section i is held out when i % HELD_OUT_EVERY == HELD_OUT_PHASE (about a tenth of the text);
  4. any paragraph that occurs verbatim in a held-out section is removed from the training sections,
     so the held-out loss measures text the model has not seen.

Each section becomes one document. Even-numbered training documents are rendered as a chat exchange
(the heading as the user's turn, the body as the assistant's), so the chat template below produces
text the model has seen; the rest are plain text ending in the end-of-text token.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_EVERY = 10
HELD_OUT_PHASE = 5
BOS, EOS, IM_START, IM_END = "<|endoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = ["<|endoftext|>", IM_START, IM_END]
# ChatML: what the training documents look like, and what add_generation_prompt appends.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_UNDERLINE = re.compile(r"(\*+|=+|-+)")


class CorpusError(Exception):
    """The corpus on this Python is not the one the built-in model was trained on."""


@dataclass(frozen=True)
class Section:
    heading: str
    body: str

    def plain(self) -> str:
        return f"{self.heading}\n\n{self.body}{EOS}"

    def chat(self) -> str:
        return (
            f"{IM_START}user\n{self.heading}{IM_END}\n"
            f"{IM_START}assistant\n{self.body}{IM_END}\n{EOS}"
        )


@dataclass(frozen=True)
class Corpus:
    train: list[Section]
    held_out: list[Section]
    sha256: str  # of the raw topics, sorted by key, as JSON
    python_version: str

    def train_documents(self) -> list[str]:
        return [s.chat() if i % 2 == 0 else s.plain() for i, s in enumerate(self.train)]

    def held_out_documents(self) -> list[str]:
        return [s.plain() for s in self.held_out]


def topics_sha256(topics: dict[str, str]) -> str:
    blob = json.dumps(topics, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def split_sections(text: str) -> list[Section]:
    """Cut one topic at its headings; text before the first heading is a section with no heading."""
    lines = text.split("\n")
    heads = [
        i
        for i in range(len(lines) - 1)
        if lines[i].strip()
        and _UNDERLINE.fullmatch(lines[i + 1])
        and len(lines[i + 1]) == len(lines[i].rstrip())
    ]
    sections: list[Section] = []
    if not heads or heads[0] != 0:
        body = _trim("\n".join(lines[: heads[0] if heads else len(lines)]))
        if body:
            sections.append(Section("", body))
    for a, b in zip(heads, heads[1:] + [len(lines)]):
        body = _trim("\n".join(lines[a + 2 : b]))
        if body:
            sections.append(Section(lines[a].strip(), body))
    return sections


def _trim(text: str) -> str:
    """Drop blank lines and trailing spaces around a block, keeping the first line's indent (code)."""
    return text.rstrip().lstrip("\n")


def _paragraphs(text: str) -> list[str]:
    return [_trim(p) for p in re.split(r"\n\s*\n", text) if p.strip()]


def build_corpus(topics: dict[str, str] | None = None) -> Corpus:
    """The deterministic train/held-out split of `pydoc_data.topics` (see the module docstring)."""
    if topics is None:
        from pydoc_data.topics import topics as stdlib_topics

        topics = dict(stdlib_topics)
    unique: dict[Section, None] = {}
    for key in sorted(topics):
        for section in split_sections(topics[key]):
            unique.setdefault(section, None)
    sections = list(unique)
    held_out = [s for i, s in enumerate(sections) if i % HELD_OUT_EVERY == HELD_OUT_PHASE]
    held_paras = {p for s in held_out for p in _paragraphs(s.body)}
    train = []
    for i, s in enumerate(sections):
        if i % HELD_OUT_EVERY == HELD_OUT_PHASE:
            continue
        body = "\n\n".join(p for p in _paragraphs(s.body) if p not in held_paras)
        if body:
            train.append(Section(s.heading, body))
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(train, held_out, topics_sha256(topics), version)


def train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style byte alphabet, so any text encodes) trained on `documents`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens are split out first so BPE never merges across a document boundary.
    pieces = [p for d in documents for p in re.split(r"<\|[a-z_]+\|>", d) if p]
    tok.train_from_iterator(pieces, trainer=trainer)
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }


def save_tokenizer(tok, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = tokenizer_config(model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
