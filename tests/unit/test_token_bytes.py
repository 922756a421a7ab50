"""`Tokenizer.token_bytes`, what logprobs report for a token: the bytes of a text's tokens, joined,
are its decoded text's UTF-8, for a byte-level BPE (the built-in model's; a character split over
tokens included) and a SentencePiece BPE with byte fallback read from a GGUF."""

import gguf
import pytest
from _gguf_vocab import HOSTILE, sentencepiece_fields, train_sentencepiece, write_gguf

from tandem.builtin import default_model_dir
from tandem.loaders.gguf.tokenizer import load_gguf_tokenizer
from tandem.loaders.tokenizer import Tokenizer

TEXTS = [t for t in HOSTILE if "<" not in t] + ["héllo wörld ✓ 你好 👋🏽", "naïve café"]


def test_byte_level_tokens_join_to_the_decoded_text():
    tok = Tokenizer.from_dir(default_model_dir())
    split = 0
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces) == tok.decode(ids).encode(), text
        split += sum(1 for p in pieces if _not_utf8(p))
    assert split > 0  # some token held part of a character: its bytes are still exact
    assert tok.token_bytes(2) == b"<|im_end|>"  # an added token: its text
    assert tok.token_bytes(10**6) == b""


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_sentencepiece_byte_fallback_tokens_join_to_the_decoded_text(tmp_path, prefix):
    path = write_gguf(
        tmp_path / "spm.gguf", "llama", sentencepiece_fields(train_sentencepiece(prefix), prefix)
    )
    tok = load_gguf_tokenizer(gguf.GGUFReader(path), path)
    fallback = 0
    for text in TEXTS:
        ids = tok.encode(text)
        joined = b"".join(tok.token_bytes(i) for i in ids).decode()
        want = tok.decode(ids)
        assert joined in (want, " " + want), text  # the decoder strips the dummy prefix's space
        fallback += sum(
            1 for i in ids if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] > 127
        )
    assert fallback > 0  # characters outside the vocabulary came as byte tokens


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return True
    return False
