"""The tokenizer and chat template a GGUF file carries in its metadata, as tandem's `Tokenizer`.

A GGUF has no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`, `token_type`,
`scores`, `merges`) under llama.cpp's keys and names the rest (`tokenizer.ggml.model`, `.pre`). This
module rebuilds, as a `tokenizers` object, the tokenizer llama.cpp runs on the same file:

- `gpt2`: byte-level BPE. The text is split by the regexes llama.cpp uses for `tokenizer.ggml.pre`
  (`pre_tokenizers.py`), each piece is spelled in the GPT-2 byte alphabet and merged by the file's
  merges (rank = position in the list).
- `llama`: SentencePiece BPE. Spaces become `▁`, and every stretch of text that starts the input or
  follows a special token gets a leading `▁` when `tokenizer.ggml.add_space_prefix` (default true)
  says so; then the adjacent pair whose concatenation is the best-scoring vocabulary token merges
  first, repeatedly; a character no token covers becomes its UTF-8 bytes as `<0xXX>` tokens. That
  is a BPE whose merges are every split of every token into two tokens, ranked by the token's score.

In both, tokens typed control, unknown or user-defined (and the end-of-turn tokens llama.cpp
recognizes by their text, `END_OF_TURN_TEXTS`) are matched whole in the text before anything else,
as llama.cpp does when it parses special tokens; control ones are dropped when decoding.

Generation stops on `eos_token_ids`: the EOS id, `eot_token_id` / `eom_token_id` when present, and
the ids of the `END_OF_TURN_TEXTS` tokens (llama.cpp's end-of-generation set, less its fill-in-the-
middle tokens). In gpt-oss's harmony vocabulary (`<|return|>` and `<|call|>` present) `<|end|>`
ends a message, not the turn, so it is not a stop there (llama.cpp's rule too). A file without a BOS / EOS id key gets llama.cpp's SentencePiece defaults (1 / 2)
and none for BPE (llama.cpp's 11 there is a relic of one model's vocabulary).

Everything read is checked first: a wrong type, a count past `MAX_VOCAB` / `MAX_MERGES`, arrays of
different lengths, an id outside the vocabulary, a duplicate token or a merge of tokens that do not
exist is a typed error naming the file and the key, never a `tokenizers` panic.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tandem.loaders.gguf.pre_tokenizers import PRE_TOKENIZERS, PreTokenizerSpec
from tandem.loaders.gguf.tokenizer_fields import (
    Metadata,
    TokenizerFieldError,
    TokenizerLengthError,
    UnknownTokenizerError,
)
from tandem.loaders.tokenizer import Tokenizer

K = gguf.Keys.Tokenizer
T = gguf.TokenType

MAX_VOCAB = 1 << 21  # the largest real vocabularies are ~262k tokens
MAX_MERGES = 1 << 22
MAX_TOKEN_BYTES = 1 << 16
MAX_TEMPLATE_BYTES = 1 << 20  # real chat templates are a few kB to ~30 kB

# Tokens llama.cpp treats as end of generation by their text (src/llama-vocab.cpp).
END_OF_TURN_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<end_of_utterance>",
        "<|return|>",  # gpt-oss's harmony: the answer's end
        "<|call|>",  # and a tool call's
    )
)
HARMONY_ENDS = ("<|return|>", "<|call|>")  # with both, <|end|> only ends a message

_SPECIAL_TYPES = (T.CONTROL, T.UNKNOWN)
_ID_KEYS = (K.BOS_ID, K.EOS_ID, K.UNK_ID, K.PAD_ID, K.EOT_ID, K.EOM_ID)
# Ids a file without the key gets: llama.cpp's SentencePiece defaults; none for BPE (llama.cpp's
# 11 there is a relic of one model's vocabulary).
_DEFAULT_IDS: dict[str, dict[str, int]] = {
    "gpt2": {},
    "llama": {K.BOS_ID: 1, K.EOS_ID: 2, K.UNK_ID: 0},
}


def load_gguf_tokenizer(reader: gguf.GGUFReader, path: Path) -> Tokenizer:
    """The file's tokenizer, chat template, BOS/EOS rules and stop ids (see the module docstring).
    Raises a `GGUFTokenizerError` subclass when the metadata is missing, malformed or absurd."""
    path = Path(path)
    meta = Metadata(reader, path)
    kind = meta.string(K.MODEL, required=True)
    if kind not in _DEFAULT_IDS:
        raise UnknownTokenizerError(
            f"{path}: {K.MODEL} {kind!r} is not a tokenizer tandem builds (gpt2, llama)"
        )
    tokens, types, vocab = _vocabulary(meta)
    n = len(tokens)
    ids = {
        key: meta.token_id(key, n, default=_in_range(_DEFAULT_IDS[kind].get(key), n))
        for key in _ID_KEYS
    }
    if kind == "gpt2":
        tok, add_bos = _gpt2(meta, vocab)
    else:
        tok, add_bos = _llama(meta, tokens, vocab, ids[K.UNK_ID]), True
    end_of_turn = {i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS}
    _add_special_tokens(tok, tokens, types, end_of_turn)
    stop = [i for i in (ids[K.EOS_ID], ids[K.EOT_ID], ids[K.EOM_ID]) if i is not None]
    stop += sorted(end_of_turn - set(stop))
    if all(t in {tokens[i] for i in end_of_turn} for t in HARMONY_ENDS):
        stop = [i for i in stop if tokens[i] != "<|end|>"]

    def text(key: str) -> str | None:
        return tokens[ids[key]] if ids[key] is not None else None

    config = {
        "bos_token": text(K.BOS_ID),
        "eos_token": text(K.EOS_ID),
        "unk_token": text(K.UNK_ID),
        "pad_token": text(K.PAD_ID),
        "add_bos_token": meta.bool(K.ADD_BOS, default=add_bos),
        "add_eos_token": meta.bool(K.ADD_EOS, default=False),
        "chat_template": meta.string(K.CHAT_TEMPLATE, max_bytes=MAX_TEMPLATE_BYTES),
    }
    return Tokenizer(
        tok,
        config,
        path,
        eos_token_ids=tuple(dict.fromkeys(stop)),
        template_origin=f"{path}: {K.CHAT_TEMPLATE}",
    )


def _vocabulary(meta: Metadata) -> tuple[list[str], list[int], dict[str, int]]:
    """(tokens, token types, token -> id), checked: a vocabulary, types as long, no token twice."""
    tokens = meta.strings(K.LIST, required=True, limit=MAX_VOCAB, max_bytes=MAX_TOKEN_BYTES)
    assert tokens is not None
    if not tokens:
        raise TokenizerLengthError(f"{meta.path}: {K.LIST} is empty")
    types = meta.ints(K.TOKEN_TYPE, length=len(tokens)) or [int(T.NORMAL)] * len(tokens)
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for them
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise TokenizerFieldError(f"{meta.path}: {K.LIST} holds {dup[:80]!r} twice")
    return tokens, types, vocab


def _gpt2(meta: Metadata, vocab: dict[str, int]) -> tuple[HFTokenizer, bool]:
    """The byte-level BPE and its BOS default, for the file's `tokenizer.ggml.pre`."""
    pre = meta.string(K.PRE) or "default"  # llama.cpp's fallback for a file that names none
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise UnknownTokenizerError(
            f"{meta.path}: {K.PRE} {pre!r} is not a pre-tokenizer tandem knows "
            f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = meta.strings(K.MERGES, required=True, limit=MAX_MERGES, max_bytes=MAX_TOKEN_BYTES)
    assert merges is not None
    return _byte_level_bpe(vocab, _split_merges(merges, vocab, meta.path), spec), spec.add_bos


def _llama(
    meta: Metadata, tokens: list[str], vocab: dict[str, int], unk: int | None
) -> HFTokenizer:
    scores = meta.floats(K.SCORES, length=len(tokens), required=True)
    assert scores is not None
    add_prefix = meta.bool(K.ADD_PREFIX, default=True)
    return _sentencepiece_bpe(
        tokens, scores, vocab, add_prefix, tokens[unk] if unk is not None else None
    )


def _in_range(i: int | None, n: int) -> int | None:
    return i if i is not None and i < n else None


def _split_merges(
    merges: Sequence[str], vocab: dict[str, int], path: Path
) -> list[tuple[str, str]]:
    """`"a b"` -> `("a", "b")`, split at the first space after the first character (llama.cpp's
    rule), each part and their concatenation a vocabulary token."""
    out = []
    for i, m in enumerate(merges):
        cut = m.find(" ", 1)
        left, right = (m[:cut], m[cut + 1 :]) if cut > 0 else ("", "")
        if not (left in vocab and right in vocab and left + right in vocab):
            raise TokenizerFieldError(
                f"{path}: {K.MERGES}[{i}] = {m[:80]!r} is not two vocabulary tokens whose "
                "concatenation is one"
            )
        out.append((left, right))
    return out


def _byte_level_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], spec: PreTokenizerSpec
) -> HFTokenizer:
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(
    tokens: list[str],
    scores: list[float],
    vocab: dict[str, int],
    add_prefix: bool,
    unk: str | None,
) -> HFTokenizer:
    """SentencePiece's BPE as a rank-ordered BPE: every split of a token into two tokens is a merge,
    ranked by the token's score, best first. Ties in score keep the order transformers' GGUF
    loader gives them (longer left part first, then token order), so the two agree there too;
    llama.cpp breaks a tie by the leftmost position instead, which no rank order can express
    (real SentencePiece vocabularies give their mergeable tokens distinct scores)."""
    merges: list[tuple[str, str, float]] = []
    for tok_text, score in zip(tokens, scores):
        local = [
            (tok_text[:k], tok_text[k:], score)
            for k in range(1, len(tok_text))
            if tok_text[:k] in vocab and tok_text[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    has_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b, _ in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=has_bytes,
        )
    )
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    out = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        out.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(out)
    return tok


def _add_special_tokens(
    tok: HFTokenizer, tokens: list[str], types: list[int], end_of_turn: set[int]
) -> None:
    """Control, unknown and end-of-turn tokens as special added tokens (matched whole, dropped when
    decoding), user-defined ones as plain added tokens (matched whole, kept)."""
    special = [
        AddedToken(t, special=True, normalized=False)
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in _SPECIAL_TYPES or i in end_of_turn
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty == T.USER_DEFINED and i not in end_of_turn
    ]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
