"""The block-layout table against gguf-py's own sizes."""

import pytest
from gguf.constants import GGML_QUANT_SIZES

from tandem.models.quant.blocks import LAYOUTS, UnsupportedTypeError, layout


def test_every_layout_matches_gguf_py_block_size_and_bytes():
    for t in LAYOUTS:
        assert GGML_QUANT_SIZES[t.type_id] == (t.block_size, t.block_bytes), t.name


def test_row_bytes_refuses_a_partial_block():
    q4k = layout(12)
    assert q4k.row_bytes(512) == 288
    with pytest.raises(ValueError, match="multiple of 256"):
        q4k.row_bytes(192)


def test_an_unknown_type_id_is_refused_typed():
    with pytest.raises(UnsupportedTypeError, match="4242"):
        layout(4242)
