import base58
import pytest

from tandem.cluster.ring_config import parse_ring_config
from tandem.cluster.token import (
    JoinTokenError,
    TokenCorrupt,
    TokenForeign,
    TokenMalformed,
    TokenTruncated,
    TokenVersionError,
    _b58_fixed,
    _b58_fixed_decode,
    decode_token,
    encode_token,
    new_topology,
    parse_layout,
    token_qr,
)


def _topo():
    return new_topology(["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"], tp=2, pp=2)


def test_join_token_round_trips_the_topology_and_secret():
    topo = _topo()
    assert decode_token(encode_token(topo)) == topo
    assert len(topo.secret) == 64 and topo.secret != _topo().secret


def test_join_token_with_any_one_character_changed_is_refused():
    token = encode_token(_topo())
    alphabet = base58.alphabet.decode()
    for i, c in enumerate(token):
        other = alphabet[(alphabet.index(c) + 7) % len(alphabet)]
        with pytest.raises(JoinTokenError):
            decode_token(token[:i] + other + token[i + 1 :])


def test_truncated_join_token_is_refused_as_truncated():
    token = encode_token(_topo())
    for cut in (len(token) - 1, len(token) // 2, 6):
        with pytest.raises(TokenTruncated, match="truncated"):
            decode_token(token[:cut])


def test_foreign_and_non_base58_tokens_are_refused_with_their_own_errors():
    with pytest.raises(TokenForeign):
        decode_token(base58.b58encode(b"SSH-2.0-OpenSSH_9.6 some other string").decode())
    with pytest.raises(TokenForeign):
        decode_token("zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz")
    with pytest.raises(TokenMalformed, match="base58"):
        decode_token("0OIl+/=")
    with pytest.raises(TokenMalformed):
        decode_token("   ")


def test_newer_token_version_is_refused_naming_both_versions():
    token = encode_token(_topo())
    header = bytearray(_b58_fixed_decode(token[:9], 6))
    header[3] = 9
    with pytest.raises(TokenVersionError, match="v9.*v1"):
        decode_token(_b58_fixed(bytes(header)) + token[9:])


def test_ring_configs_close_the_ring_and_point_at_the_head():
    topo = new_topology(["a", "b", "c"], tp=3, pp=1, base_port=40000)
    cfgs = [topo.ring_config(r) for r in range(3)]
    assert [c["port"] for c in cfgs] == [40000, 40001, 40002]
    assert [(c["right_ip"], c["right_port"]) for c in cfgs] == [
        ("b", 40001),
        ("c", 40002),
        ("a", 40000),
    ]
    assert cfgs[0]["master_ip"] is None and cfgs[1]["master_ip"] == "a"
    assert all(c["master_port"] == 40003 and c["secret"] == topo.secret for c in cfgs)
    parsed = [parse_ring_config(c) for c in cfgs]  # the collectives' own RING_CONFIG parser
    assert [p.rank for p in parsed] == [0, 1, 2] and {p.cluster_id for p in parsed} == {
        topo.cluster_id
    }


def test_layout_parsing_covers_tp_pp_and_grids_and_refuses_mismatch():
    assert parse_layout(None, 4) == (4, 1)
    assert parse_layout("pp", 3) == (1, 3)
    assert parse_layout("tp2xpp2", 4) == (2, 2)
    assert parse_layout("tp=2,pp=3", 6) == (2, 3)
    with pytest.raises(ValueError, match="needs 4 hosts"):
        parse_layout("tp2xpp2", 3)
    with pytest.raises(ValueError):
        parse_layout("dp2", 2)
    with pytest.raises(TokenCorrupt):
        new_topology(["a", "b"], tp=3, pp=1)


def test_token_qr_draws_a_terminal_block_code():
    qr = token_qr(encode_token(_topo()))
    lines = qr.splitlines()
    assert len(lines) > 20 and "█" in qr
