"""The byte-level BPE pre-tokenizers llama.cpp selects by `tokenizer.ggml.pre`, as a table.

A GGUF names its pre-tokenizer instead of storing it. Each name maps to the list of regexes
llama.cpp's `llm_tokenizer_bpe` applies in order (each splits every piece the previous one left,
keeping matched and unmatched text as separate pieces: `tokenizers`' `Split(..., "isolated")`),
and to two flags llama.cpp sets with it: `ignore_merges` (a piece that is already a whole vocabulary
token is taken as it is, without running the merges) and `add_bos` (the default when the file has
no `tokenizer.ggml.add_bos_token`). The regexes are llama.cpp's own strings (`src/llama-vocab.cpp`),
except where llama.cpp rewrites a tokenizer.json regex for `std::regex` (`(?i:...)` spelled out,
`\\p{Lu}` emulated with lookaheads): there the original regex is used, which `tokenizers`' regex
engine runs as written and which matches the same text.

A name not in the table is refused (`UnknownPreTokenizerError` in `tokenizer.py`): guessing a
pre-tokenizer changes the token ids silently, which llama.cpp also refuses to do.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreTokenizerSpec:
    regexes: tuple[str, ...]  # applied in order, each one to every piece the previous left
    ignore_merges: bool = False  # a piece that is a whole vocabulary token skips the merges
    add_bos: bool = False  # the BOS default when the file does not say


# The GPT-2 pattern (without the trailing `|\s+`: unmatched whitespace stays a piece of its own,
# which is what that alternative matched).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DEFAULT = PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2 = PreTokenizerSpec((GPT2,))
_DIGITS_GPT2 = PreTokenizerSpec((r"\p{N}", GPT2))  # every digit its own piece, then GPT-2
_LLAMA3 = PreTokenizerSpec((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizerSpec((QWEN2,))

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion"), _GPT2),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizerSpec((LLAMA3,))),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"), _QWEN2
    ),
    "qwen35": PreTokenizerSpec((QWEN35,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _DIGITS_GPT2,
    ),
    "falcon": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")),
    "tekken": PreTokenizerSpec((TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4"), PreTokenizerSpec((GPT4O,))),
    "deepseek-coder": PreTokenizerSpec(
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
    ),
}
