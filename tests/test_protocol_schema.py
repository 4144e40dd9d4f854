"""The wire protocol's messages: round trips, strict decoding and fuzzing of `decode_message`."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import msgpack
import pytest
from groundswell.protocol import schema
from groundswell.protocol.schema import (
    MAX_SMALL,
    MESSAGES,
    Ack,
    Decision,
    DecisionReply,
    DecisionRequest,
    HaveReport,
    Join,
    PeerRecord,
    ProtocolError,
    StateReply,
    StateRequest,
    decode_message,
    encode_message,
)
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from schema_cases import (
    ALL,
    EXAMPLES,
    FUZZ,
    HINTS,
    MESSAGE_STRATEGY,
    MIN_FUZZ,
    VALID_ENCODINGS,
    _mutated,
    _raw,
    _values,
)


# --- round trips ---------------------------------------------------------------------------------
def test_every_kind_has_an_example():
    assert set(EXAMPLES) == set(MESSAGES)
    assert all(cls.KIND == kind for kind, cls in MESSAGES.items())
    assert len({cls.KIND for cls in ALL}) == len(ALL)  # no two classes share a wire tag


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_round_trip(kind):
    msg = EXAMPLES[kind]
    data = encode_message(msg)
    assert msgpack.unpackb(data) == [kind, _values(msg)]  # the documented wire shape
    assert decode_message(data, type(msg)) == msg
    assert decode_message(data, ALL) == msg
    assert decode_message(bytearray(data), type(msg)) == msg



def test_round_trip_random_messages():
    tried = []

    @FUZZ
    @given(MESSAGE_STRATEGY)
    def check(msg):
        tried.append(msg.KIND)
        data = encode_message(msg)
        assert decode_message(data, type(msg)) == msg
        assert decode_message(data, ALL) == msg

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ and len(set(tried)) == len(MESSAGES)


# --- strict decoding -----------------------------------------------------------------------------
def test_wrong_kind_rejected():
    data = encode_message(EXAMPLES["ack"])
    with pytest.raises(ProtocolError, match="kind"):
        decode_message(data, Join)
    with pytest.raises(ProtocolError, match="kind"):
        decode_message(data, (Join, Decision, StateRequest))  # a known kind, but not an expected one
    assert decode_message(data, (Join, Ack)) == EXAMPLES["ack"]
    for kind in ("nope", "", "ACK", "ack "):
        with pytest.raises(ProtocolError, match="kind"):
            decode_message(_raw(kind, _values(EXAMPLES["ack"])), ALL)


@pytest.mark.parametrize("obj", [
    None, 5, "ack", b"ack", [], ["ack"], ["ack", [True, "x"], 1], [1, [True, "x"]], [b"ack", [True, "x"]],
    ["ack", "notalist"], ["ack", b"\x01"], ["ack", None], [["ack"], [True, "x"]],
])
def test_bad_shape_rejected(obj):
    with pytest.raises(ProtocolError):
        decode_message(msgpack.packb(obj, use_bin_type=True), ALL)


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_wrong_field_count_rejected(kind):
    values = _values(EXAMPLES[kind])
    assert decode_message(_raw(kind, values), ALL) == EXAMPLES[kind]
    with pytest.raises(ProtocolError, match="fields"):
        decode_message(_raw(kind, values + [0]), ALL)
    if values:
        with pytest.raises(ProtocolError, match="fields"):
            decode_message(_raw(kind, values[:-1]), ALL)


def _wrong_values(hint: typing.Any, meta: typing.Mapping) -> list:
    """Values of the wrong type, out of range, or too large for a field."""
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        out = ["notalist", b"", 7, None, True]
        out += [[w] for w in _wrong_values(item, meta)]  # one bad item spoils the list
        if meta["max_items"] <= 4096:
            good = {str: "", bytes: b"", float: 0.5}[item]
            out.append([good] * (meta["max_items"] + 1))
        return out
    if hint is bool:
        return [1, 0, 1.0, "true", b"\x01", None, []]
    if hint is int:
        out = [True, False, "1", b"1", 1.5, 1.0, None, []]
        if meta["lo"] is not None:
            out.append(meta["lo"] - 1)
        if meta["hi"] is not None:
            out.append(meta["hi"] + 1)
        return out
    if hint is float:
        out = [True, False, "1.0", b"", None, [], math.nan, -math.nan, math.inf, -math.inf]
        if meta["lo"] is not None:
            out.append(meta["lo"] - 0.5)
        if meta["hi"] is not None:
            out.append(meta["hi"] + 0.5)
        return out
    if hint is str:
        out = [1, 0, True, b"x", None, ["x"], 1.5]
        if meta["max_len"] <= 1 << 16:
            out.append("x" * (meta["max_len"] + 1))
        return out
    if hint is bytes:
        out = ["x", 1, True, None, [b"x"], 1.5]
        if meta["max_len"] <= 4 * MAX_SMALL:
            out.append(b"x" * (meta["max_len"] + 1))
        return out
    raise AssertionError(hint)


def _bad_field_cases():
    for kind, cls in sorted(MESSAGES.items()):
        for i, f in enumerate(dataclasses.fields(cls)):
            for j, bad in enumerate(_wrong_values(HINTS[kind][f.name], f.metadata)):
                label = repr(bad) if not isinstance(bad, (str, bytes, list)) or len(bad) < 20 else f"<{len(bad)}>"
                yield pytest.param(kind, i, bad, id=f"{kind}.{f.name}[{j}]={label[:30]}")


@pytest.mark.parametrize("kind,index,bad", list(_bad_field_cases()))
def test_bad_field_rejected(kind, index, bad):
    values = _values(EXAMPLES[kind])
    values[index] = bad
    data = _raw(kind, values)
    name = dataclasses.fields(MESSAGES[kind])[index].name
    with pytest.raises(ProtocolError) as err:
        decode_message(data, ALL, max_bytes=max(MAX_SMALL, len(data)))
    assert f"{kind}.{name}" in str(err.value)  # the error names the field


def test_specific_type_confusions():
    """The classic confusions, spelled out: bool for int, int for str, NaN for float, int for bool."""
    with pytest.raises(ProtocolError, match="join.round"):
        decode_message(_raw("join", [True, True, False]), Join)
    with pytest.raises(ProtocolError, match="ack.reason"):
        decode_message(_raw("ack", [True, 5]), Ack)
    with pytest.raises(ProtocolError, match="ack.ok"):
        decode_message(_raw("ack", [1, "x"]), Ack)
    with pytest.raises(ProtocolError, match="get-decision.wait_s"):
        decode_message(_raw("get-decision", [1, 0, math.nan]), DecisionRequest)
    with pytest.raises(ProtocolError, match="peer.loss"):
        decode_message(_raw("peer", _values(EXAMPLES["peer"])[:7] + [math.nan, 0, 0.0, [], 0, [], [], [], -1]), PeerRecord)
    # an int where a float is expected is fine, and comes back as a float
    got = decode_message(_raw("get-decision", [1, 0, 3]), DecisionRequest)
    assert got.wait_s == 3.0 and type(got.wait_s) is float
    # float32 NaN on the wire is rejected too
    nan32 = b"\x92\xacget-decision\x93\x01\x00\xca\x7f\xc0\x00\x00"
    assert math.isnan(msgpack.unpackb(nan32)[1][2])
    with pytest.raises(ProtocolError, match="wait_s"):
        decode_message(nan32, DecisionRequest)


def test_bounds_are_inclusive():
    hi = decode_message(_raw("get-decision", [1 << 40, 1 << 20, 3600.0]), DecisionRequest)
    assert (hi.round, hi.attempt, hi.wait_s) == (1 << 40, 1 << 20, 3600.0)
    assert decode_message(_raw("get-state", [-1, True]), StateRequest).min_round == -1
    with pytest.raises(ProtocolError, match="min_round"):
        decode_message(_raw("get-state", [-2, True]), StateRequest)
    with pytest.raises(ProtocolError, match="direct_port"):
        decode_message(_raw("state", [0, "", b"", 0, 65536, b"", b"", "", False]), StateReply)
    with pytest.raises(ProtocolError, match="direct_token"):
        decode_message(_raw("state", [0, "", b"", 0, 1, b"t" * 33, b"", "", False]), StateReply)
    with pytest.raises(ProtocolError, match="direct_key"):
        decode_message(_raw("state", [0, "", b"", 0, 1, b"t" * 32, b"k" * 33, "", False]), StateReply)
    with pytest.raises(ProtocolError, match="params_hash"):
        decode_message(_raw("state", [0, "", b"", 0, 1, b"t" * 32, b"k" * 32, "h" * 65, False]), StateReply)
    assert decode_message(_raw("ack", [False, "r" * 512]), Ack).reason == "r" * 512
    with pytest.raises(ProtocolError, match="ack.reason"):
        decode_message(_raw("ack", [False, "r" * 513]), Ack)
    peers = ["p"] * 4096
    assert decode_message(_raw("have", [0, 0, 0, peers, [b"d" * 16] * len(peers), []]), HaveReport).contributors == peers
    with pytest.raises(ProtocolError, match="have.contributors"):
        decode_message(_raw("have", [0, 0, 0, peers + ["p"], [], []]), HaveReport)
    with pytest.raises(ProtocolError):  # 2**64 - 1 does not fit any bounded field
        decode_message(_raw("peer", _values(EXAMPLES["peer"])[:8] + [(1 << 64) - 1, 0.0]), PeerRecord)


def test_oversized_message_rejected_before_parsing(monkeypatch):
    msg = DecisionReply(decision=b"z" * 5000)
    data = encode_message(msg)
    assert decode_message(data, DecisionReply, max_bytes=len(data)) == msg  # exactly at the limit: fine

    def boom(*args, **kwargs):
        raise AssertionError("unpackb was called on an oversized message")

    monkeypatch.setattr(schema.msgpack, "unpackb", boom)
    with pytest.raises(ProtocolError, match="over the limit"):
        decode_message(data, DecisionReply, max_bytes=len(data) - 1)
    with pytest.raises(ProtocolError, match="over the limit"):
        decode_message(b"\x00" * (MAX_SMALL + 1), ALL)  # the default budget


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92", b"\x92\xa3ack", b"\xff" * 16, b"not msgpack at all",
    b"\xdd\xff\xff\xff\xff",  # an array that claims 4 billion items
    b"\xc6\xff\xff\xff\xff",  # bin32 that claims 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 that claims 4 GiB
    b"\x92\xa3ack\x92\xc3\xa1x\x00",  # a valid message with a trailing byte
    b"\x81\xa1k\xa1v",  # a map
    b"\x92\xa3ack\x81\xa1k\xa1v",  # a map in place of the field list
    b"\xc7\x01\x05x",  # an ext type
    b"\xd6\xff\x00\x00\x00\x00",  # a msgpack timestamp
    b"\x92\xa3ack\x92\xc3\xa2\xff\xfe",  # invalid utf-8 in a str
    b"\x91" * 100_000 + b"\xc0",  # nesting far deeper than any parser stack
])
def test_garbage_rejected(data):
    with pytest.raises(ProtocolError):
        decode_message(data, ALL)


def test_non_bytes_rejected():
    for obj in ("ack", None, 5, memoryview(encode_message(EXAMPLES["ack"])), [b"x"]):
        with pytest.raises(ProtocolError):
            decode_message(obj, ALL)  # type: ignore[arg-type]


# --- fuzzing -------------------------------------------------------------------------------------
def _decode_or_protocol_error(data: bytes, expect=ALL, **kwargs) -> object | None:
    try:
        return decode_message(data, expect, **kwargs)
    except ProtocolError:
        return None


def test_fuzz_random_bytes():
    tried = []

    @FUZZ
    @given(st.binary(max_size=512))
    def check(data):
        tried.append(data)
        msg = _decode_or_protocol_error(data)
        if msg is not None:  # whatever decodes must be a well-formed message that encodes back to itself
            assert isinstance(msg, ALL) and decode_message(encode_message(msg), ALL) == msg

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ



def test_fuzz_mutated_valid_messages():
    tried, decoded = [], []

    @FUZZ
    @given(_mutated(VALID_ENCODINGS))
    def check(data):
        tried.append(data)
        msg = _decode_or_protocol_error(data)
        if msg is not None:  # whatever still decodes must be a well-formed message of a known kind
            decoded.append(msg)
            assert isinstance(msg, ALL)
            assert decode_message(encode_message(msg), ALL) == msg

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ


def test_fuzz_structured_values():
    """Well-formed `[kind, [values...]]` with arbitrary values: reaches the field checks, not msgpack."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                        st.text(max_size=8), st.binary(max_size=8))
    values = st.lists(st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=11)
    tried = []

    @FUZZ
    @given(st.sampled_from(sorted(MESSAGES)), values)
    def check(kind, vals):
        tried.append(kind)
        msg = _decode_or_protocol_error(_raw(kind, vals))
        if msg is not None:  # accepted values are of the kind asked for and survive a round trip
            assert msg.KIND == kind and decode_message(encode_message(msg), ALL) == msg

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ



@pytest.mark.parametrize("max_shards", [1, 16, 17, 32, 64, 4096])
def test_a_commit_of_a_full_round_fits_a_control_message(max_shards):
    # Found by a review of the wire boundary: 2400 contributors at 16 shards made a commit of
    # 1.08 MB, which every receiver refused: a round over ~2200 members could never commit. A
    # round's members are capped so that its biggest commit (every member a contributor and a
    # server, a digest per contributor and shard) stays within MAX_SMALL, envelope included.
    from groundswell.protocol.envelope import seal, unseal
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import MAX_SMALL, Decision
    from groundswell.protocol.shards import max_members

    leader = Identity.generate()
    members = sorted(Identity.generate().peer_id for _ in range(max_members(max_shards)))
    shards = min(max_shards, len(members))
    decision = Decision(7, 3, "commit", members, members, members, leader.peer_id, members[:shards], shards,
                        1.7e9, [bytes(range(16))] * (len(members) * shards))
    signed = seal(leader, "a-run-id-of-some-length", decision)
    assert len(signed) <= MAX_SMALL - 4096, f"{len(members)} members x {shards} shards: {len(signed)} bytes"
    assert unseal(signed, "a-run-id-of-some-length", Decision)[1] == decision
