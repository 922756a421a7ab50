"""Hostile tokenizer metadata gets a typed error that names the file and the key."""

from __future__ import annotations

import gguf
import pytest
from _gguf_vocab import write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tandem.loaders.gguf.tokenizer as gt
from tandem.loaders.gguf.tokenizer_fields import (
    GGUFTokenizerError,
    MissingTokenizerFieldError,
    TokenizerFieldError,
    TokenizerLengthError,
    TokenizerSizeError,
    UnknownTokenizerError,
)
from tandem.loaders.safetensors_dir import ModelFileError

K = gguf.Keys.Tokenizer
V = gguf.GGUFValueType
TOKENS = ["a", "b", "ab", "Ġ", "<|end|>"]
BPE = {
    K.MODEL: "gpt2",
    K.PRE: "qwen2",
    K.LIST: TOKENS,
    K.TOKEN_TYPE: [1, 1, 1, 1, 3],
    K.MERGES: ["a b"],
    K.EOS_ID: 4,
}
SPM = {
    K.MODEL: "llama",
    K.LIST: ["<unk>", "<s>", "</s>", "▁", "a", "▁a"],
    K.SCORES: [0.0, 0.0, 0.0, -1.0, -2.0, -0.5],
    K.TOKEN_TYPE: [2, 3, 3, 1, 1, 1],
}


def load(tmp_path, fields):
    path = write_gguf(tmp_path / "t.gguf", "llama", fields)
    return gt.load_gguf_tokenizer(gguf.GGUFReader(path), path)


def test_the_base_files_are_valid(tmp_path):
    assert load(tmp_path, BPE).encode("ab<|end|>") == [2, 4]
    spm = load(tmp_path, SPM)
    assert spm.encode("a a") == [5, 5] and spm.encode_prompt("a") == [1, 5]


CASES = [
    ("unknown model", BPE, {K.MODEL: "t5"}, UnknownTokenizerError, K.MODEL),
    ("unknown pre", BPE, {K.PRE: "nonesuch-bpe"}, UnknownTokenizerError, "nonesuch-bpe"),
    ("no model", BPE, {K.MODEL: None}, MissingTokenizerFieldError, K.MODEL),
    ("no tokens", BPE, {K.LIST: None}, MissingTokenizerFieldError, K.LIST),
    ("no merges", BPE, {K.MERGES: None}, MissingTokenizerFieldError, K.MERGES),
    ("no scores", SPM, {K.SCORES: None}, MissingTokenizerFieldError, K.SCORES),
    ("types too long", BPE, {K.TOKEN_TYPE: [1] * 6}, TokenizerLengthError, K.TOKEN_TYPE),
    ("scores too short", SPM, {K.SCORES: [0.0] * 5}, TokenizerLengthError, K.SCORES),
    ("eos past the vocab", BPE, {K.EOS_ID: 5}, TokenizerFieldError, K.EOS_ID),
    ("bos past the vocab", SPM, {K.BOS_ID: 2**32 - 1}, TokenizerFieldError, K.BOS_ID),
    ("tokens as a string", BPE, {K.LIST: "a b"}, TokenizerFieldError, K.LIST),
    ("types as floats", BPE, {K.TOKEN_TYPE: [1.0] * 5}, TokenizerFieldError, K.TOKEN_TYPE),
    ("model as an int", BPE, {K.MODEL: 2}, TokenizerFieldError, K.MODEL),
    ("add_bos as an int", BPE, {K.ADD_BOS: 1}, TokenizerFieldError, K.ADD_BOS),
    ("eos as a string", BPE, {K.EOS_ID: "4"}, TokenizerFieldError, K.EOS_ID),
    ("a token twice", BPE, {K.LIST: ["a", "b", "ab", "a", "x"]}, TokenizerFieldError, "'a'"),
    ("merge of an absent token", BPE, {K.MERGES: ["a c"]}, TokenizerFieldError, K.MERGES),
    ("merge without a space", BPE, {K.MERGES: ["ab"]}, TokenizerFieldError, K.MERGES),
    ("merge to an absent token", BPE, {K.MERGES: ["b a"]}, TokenizerFieldError, K.MERGES),
    (
        "token not UTF-8",
        BPE,
        {K.LIST: ["a", "b", "ab", b"\xff\xfe", "c"]},
        TokenizerFieldError,
        K.LIST,
    ),
    (
        "template not UTF-8",
        BPE,
        {K.CHAT_TEMPLATE: (b"\xc3(", V.STRING, None)},
        TokenizerFieldError,
        K.CHAT_TEMPLATE,
    ),
    (
        "a 70 kB token",
        BPE,
        {K.LIST: ["a", "b", "ab", "x" * 70_000, "c"]},
        TokenizerSizeError,
        K.LIST,
    ),
    (
        "a 1 MiB template",
        BPE,
        {K.CHAT_TEMPLATE: "x" * (1 << 20 | 1)},
        TokenizerSizeError,
        K.CHAT_TEMPLATE,
    ),
    ("pre of 70 kB", BPE, {K.PRE: "p" * 70_000}, TokenizerSizeError, K.PRE),
]


@pytest.mark.parametrize(
    ("base", "change", "error", "named"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_metadata_gets_a_typed_error_naming_the_key(tmp_path, base, change, error, named):
    fields = {k: v for k, v in {**base, **change}.items() if v is not None}
    with pytest.raises(error) as e:
        load(tmp_path, fields)
    assert isinstance(e.value, ModelFileError)
    assert str(tmp_path / "t.gguf") in str(e.value) and named in str(e.value)


def test_counts_past_the_limits_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(gt, "MAX_VOCAB", 4)
    with pytest.raises(TokenizerSizeError, match="5 entries"):
        load(tmp_path, BPE)
    monkeypatch.setattr(gt, "MAX_VOCAB", 5)
    monkeypatch.setattr(gt, "MAX_MERGES", 0)
    with pytest.raises(TokenizerSizeError, match=K.MERGES):
        load(tmp_path, BPE)


def test_without_pre_or_eos_ids_the_llama_cpp_defaults_apply(tmp_path):
    """No pre: llama.cpp's `default` regexes. No EOS id: BPE stops only on end-of-turn texts,
    SentencePiece on its default EOS 2 too."""
    fields = {k: v for k, v in BPE.items() if k not in (K.PRE, K.EOS_ID)}
    tok = load(tmp_path, fields)
    assert tok.encode("ab") == [2] and tok.eos_token_ids == (4,) and tok.eos_token_id is None
    tok = load(tmp_path, {**SPM, K.LIST: ["<unk>", "<s>", "</s>", "▁", "a", "<|im_end|>"]})
    assert tok.eos_token_ids == (2, 5) and tok.bos_token_id == 1 and tok.add_bos_token


PIECES = ["a", "b", "ab", "", " ", "▁", "▁a", "Ġ", "Ġa", "<0x41>", "<s>", "<|im_end|>", "é", "\n"]
MERGES = ["a b", "Ġ a", "▁ a", "a  b", " a", "a ", "ab", "a b c", "b a"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["gpt2", "llama"]),
    pre=st.sampled_from(["smollm", "llama-bpe", "qwen2", "default"]),
    tokens=st.lists(st.sampled_from(PIECES), min_size=1, max_size=10),
    merges=st.lists(st.sampled_from(MERGES), min_size=1, max_size=4),
    types=st.lists(st.integers(0, 9), min_size=1, max_size=10),
    eos=st.integers(0, 12),
)
def test_random_metadata_loads_or_gets_a_typed_error(
    tmp_path, kind, pre, tokens, merges, types, eos
):
    """Never a `tokenizers` panic or a stray exception: a typed error, or a tokenizer that works."""
    fields = {K.MODEL: kind, K.PRE: pre, K.LIST: tokens, K.TOKEN_TYPE: types, K.MERGES: merges}
    fields |= {K.EOS_ID: eos, K.SCORES: [-float(i) for i in range(len(tokens))]}
    try:
        tok = load(tmp_path, fields)
    except GGUFTokenizerError:
        return
    for text in ("a b", "ab<s>é", " a\n", "", "<|im_end|> a"):
        tok.decode(tok.encode_prompt(text))
