"""The built-in model's corpus split and tokenizer (scripts/builtin_corpus.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import builtin_corpus as corpus  # noqa: E402


@pytest.fixture(scope="module")
def data() -> corpus.Corpus:
    return corpus.build_corpus()


def test_split_is_deterministic(data):
    again = corpus.build_corpus()
    assert again.train == data.train and again.held_out == data.held_out
    assert again.sha256 == data.sha256


def test_no_held_out_paragraph_appears_in_training_text(data):
    train_paras = {p for s in data.train for p in corpus._paragraphs(s.body)}
    held_paras = {p for s in data.held_out for p in corpus._paragraphs(s.body)}
    assert held_paras and not (held_paras & train_paras)


def test_held_out_is_a_small_but_real_share(data):
    train = sum(len(d) for d in data.train_documents())
    held = sum(len(d) for d in data.held_out_documents())
    assert 0.03 < held / (train + held) < 0.2
    assert len(data.held_out) >= 8


def test_sections_keep_code_indentation_and_drop_underlines():
    text = 'The "pass" statement\n********************\n\n   pass_stmt ::= "pass"\n\nNothing.\n'
    (s,) = corpus.split_sections(text)
    assert s.heading == 'The "pass" statement'
    assert s.body == '   pass_stmt ::= "pass"\n\nNothing.'


def test_same_section_under_two_underline_styles_is_kept_once():
    a = "Title\n*****\n\nBody text.\n"
    b = "Other\n=====\n\nMore.\n\n\nTitle\n=====\n\nBody text.\n"
    data = corpus.build_corpus({"a": a, "b": b})
    sections = data.train + data.held_out
    assert sorted(s.heading for s in sections) == ["Other", "Title"]


def test_byte_level_tokenizer_round_trips_any_text(data):
    tok = corpus.train_tokenizer(data.train_documents()[:20], 600)
    text = "naïve 東京 \t tabs\n\n   indented = {'x': 1}  # ✓"
    assert tok.decode(tok.encode(text).ids) == text


def test_special_tokens_are_single_ids(data):
    tok = corpus.train_tokenizer(data.train_documents()[:20], 600)
    doc = data.train_documents()[0]
    ids = tok.encode(doc).ids
    for special in corpus.SPECIAL_TOKENS:
        assert tok.token_to_id(special) in ids or special not in doc
    assert ids.count(tok.token_to_id(corpus.IM_START)) == doc.count(corpus.IM_START)
