"""Deeply nested or oversized JSON is a typed error wherever tandem reads JSON from a file or a
peer: never a RecursionError out of the parser, never a dead loader."""

from __future__ import annotations

import json
import struct

import pytest

from tandem import boundedjson
from tandem.cluster.ring_config import RingConfigError, load_ring_config
from tandem.cluster.token import TokenCorrupt, decode_token
from tandem.config import ConfigError, ModelConfig
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import CorruptFileError, ModelDir
from tandem.loaders.tokenizer import Tokenizer

DEEP = "[" * 2000 + "]" * 2000


def test_nesting_is_measured_outside_string_literals_and_bounded_before_parsing() -> None:
    assert boundedjson.nesting_depth(b'{"a": [[1], {"b": "[[[[[\\"]]]"}]}') == 3
    assert boundedjson.loads('{"a": "[[[["}', max_bytes=64, max_depth=1) == {"a": "[[[["}
    with pytest.raises(boundedjson.BoundedJSONError, match="nested 2000 levels"):
        boundedjson.loads(DEEP, max_bytes=1 << 20)
    with pytest.raises(boundedjson.BoundedJSONError, match="exceeds the limit of 10"):
        boundedjson.loads("[" + "1," * 10 + "1]", max_bytes=10)
    with pytest.raises(boundedjson.BoundedJSONError, match="not valid JSON"):
        boundedjson.loads(b"\xff{", max_bytes=10)


def test_a_config_json_nested_2000_deep_is_a_config_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ' + DEEP + "}")
    with pytest.raises(ConfigError, match="config.json: JSON nested 2001 levels"):
        ModelConfig.from_dir(tmp_path)


def test_a_ring_config_nested_2000_deep_is_a_ring_config_error(tmp_path) -> None:
    f = tmp_path / "ring.json"
    f.write_text(DEEP)
    with pytest.raises(RingConfigError, match="nested 2000 levels"):
        load_ring_config(f)


def test_a_safetensors_header_or_tokenizer_config_nested_2000_deep_is_corrupt(tmp_path) -> None:
    d = tmp_path / "m"
    make_model_dir(d, "tiny-llama", seed=0)
    (d / "tokenizer_config.json").write_text(DEEP)
    with pytest.raises(CorruptFileError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    f = d / "model.safetensors"
    raw = DEEP.encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptFileError, match="header is not a JSON object"):
        ModelDir(d)


def test_a_join_token_whose_body_nests_deeply_is_corrupt_not_a_crash() -> None:
    import hashlib

    from tandem.cluster import token as tk

    body = json.dumps({"hosts": [[[[[["x"]]]]]]}).encode()
    header = tk._HEADER.pack(tk.MAGIC, tk.TOKEN_VERSION, len(body))
    checksum = hashlib.sha256(header + body).digest()[: tk._CHECKSUM_LEN]
    text = tk._b58_fixed(header) + tk._b58_fixed(body + checksum)
    with pytest.raises(TokenCorrupt, match="nested"):
        decode_token(text)
