"""The wire protocol's messages and envelopes: round trips, strict decoding, fuzzing, DecisionBook.

Every malformed input must come out as a `ProtocolError` (never another exception type), and
every valid message must come back equal to what was sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
import typing

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import msgpack
import pytest
from groundswell.protocol import schema
from groundswell.protocol.context import DecisionBook, Membership
from groundswell.protocol.identity import Identity, peer_id_from_public_bytes
from groundswell.protocol.schema import (
    MAX_SMALL,
    MESSAGES,
    PROTOCOL_VERSION,
    Ack,
    AggregateRequest,
    AggregateShard,
    Claim,
    ClaimReply,
    ContributionsRequest,
    Decision,
    DecisionReply,
    DecisionRequest,
    HaveReport,
    Join,
    ManifestReply,
    ManifestRequest,
    Message,
    PeerRecord,
    ProbeReply,
    ProbeRequest,
    ProtocolError,
    PunchInvite,
    PunchInviteReply,
    PunchReply,
    PunchRequest,
    Seal,
    ShardContribution,
    StateReply,
    StateRequest,
    decode_message,
    encode_message,
)
from groundswell.protocol.transport import seal, unseal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

RUN = "run-test"
ID = Identity.generate()
OTHER = Identity.generate()
PEERS = [Identity.generate().peer_id for _ in range(4)]
ALL = tuple(MESSAGES.values())
FUZZ = settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
MIN_FUZZ = 400  # each fuzz test must really have tried at least this many inputs

# One representative instance per message kind; a new kind without an example fails a test below.
EXAMPLES: dict[str, Message] = {
    m.KIND: m
    for m in (
        ShardContribution(round=7, attempt=1, shard=2, first_segment=10, segments=[b"\x00\x01", b"", os.urandom(300)]),
        Ack(ok=True, reason="fine"),
        HaveReport(round=7, attempt=0, shard=3, contributors=PEERS[:3], digests=[b"d" * 16] * 3, refused=PEERS[3:4]),
        Decision(round=7, attempt=2, status="commit", contributors=PEERS[:2], trainers=PEERS[:3], servers=PEERS[1:],
                 leader=PEERS[1], sources=[PEERS[1], PEERS[2]], num_shards=2),
        DecisionRequest(round=1 << 40, attempt=0, wait_s=2.5),
        DecisionReply(decision=os.urandom(200)),
        Seal(decision=b"signed-decision"),
        Claim(round=9, attempt=3, fence=True),
        ClaimReply(ok=False, decision=os.urandom(150)),
        AggregateRequest(round=0, shard=4095, wait_s=0.0),
        AggregateShard(decision=b"d", shard=1, mode="mean", parts=[b"p1", b"p2"], clipped=PEERS[:1]),
        ContributionsRequest(round=4, attempt=1, shard=2, contributors=PEERS[:2]),
        Join(round=3, trains=True, serves=False),
        StateRequest(min_round=-1, direct=True),
        StateReply(round=-1, digest="ab" * 32, decision=b"", size=1000, direct_port=65535, direct_token=b"t" * 32,
                   direct_key=b"k" * 32),
        ManifestRequest(),
        ManifestReply(signed=b"manifest"),
        ProbeRequest(maddrs=["/ip4/192.0.2.1/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]),
        ProbeReply(reachable=True, address="192.0.2.1:4001"),
        PeerRecord(round=12, params_hash="f" * 64, role="volunteer", trains=True, serves=True,
                   maddrs=["/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4002"], reachability="public", loss=-1.5e-3,
                   bytes_sent=(1 << 62), updated=1.7e9, banned=PEERS[:1], rejected=3, scores=[f"{PEERS[0]}=+0.1"],
                   punched=PEERS[1:2]),
        PunchRequest(target=PEERS[0]),
        PunchReply(ok=True, reason="", address="/ip4/192.0.2.1/tcp/4001"),
        PunchInvite(dialer=PEERS[1], address="/ip4/192.0.2.2/tcp/4002"),
        PunchInviteReply(ok=False, reason="busy"),
    )
}
HINTS = {kind: typing.get_type_hints(cls) for kind, cls in MESSAGES.items()}


def _raw(kind: str, values: list) -> bytes:
    return msgpack.packb([kind, values], use_bin_type=True)


def _values(msg: Message) -> list:
    return [getattr(msg, f.name) for f in dataclasses.fields(msg)]


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


def _scalar_strategy(hint: type, meta: typing.Mapping) -> st.SearchStrategy:
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(min_value=meta["lo"], max_value=meta["hi"])
    if hint is float:
        return st.floats(min_value=meta["lo"], max_value=meta["hi"], allow_nan=False)
    if hint is str:
        return st.text(max_size=min(meta["max_len"], 24))
    if hint is bytes:
        return st.binary(max_size=min(meta["max_len"], 48))
    raise AssertionError(hint)


def _field_strategy(hint: typing.Any, meta: typing.Mapping) -> st.SearchStrategy:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return st.lists(_scalar_strategy(item, meta), max_size=min(meta["max_items"], 4))
    return _scalar_strategy(hint, meta)


def _message_strategy(cls: type[Message]) -> st.SearchStrategy:
    fields = {f.name: _field_strategy(HINTS[cls.KIND][f.name], f.metadata) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


MESSAGE_STRATEGY = st.sampled_from(ALL).flatmap(_message_strategy)


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
            good = {str: "", bytes: b""}[item]
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
        out = [True, False, "1.0", b"", None, [], math.nan, -math.nan]
        if meta["lo"] is not None:
            out += [meta["lo"] - 0.5, -math.inf]
        if meta["hi"] is not None:
            out += [meta["hi"] + 0.5, math.inf]
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
        decode_message(_raw("peer", _values(EXAMPLES["peer"])[:7] + [math.nan, 0, 0.0, [], 0, [], []]), PeerRecord)
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
        decode_message(_raw("state", [0, "", b"", 0, 65536, b"", b""]), StateReply)
    with pytest.raises(ProtocolError, match="direct_token"):
        decode_message(_raw("state", [0, "", b"", 0, 1, b"t" * 33, b""]), StateReply)
    with pytest.raises(ProtocolError, match="direct_key"):
        decode_message(_raw("state", [0, "", b"", 0, 1, b"t" * 32, b"k" * 33]), StateReply)
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
        _decode_or_protocol_error(data)

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ


@st.composite
def _mutated(draw, base: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(draw(base))
    op = draw(st.sampled_from(["truncate", "flip", "append", "splice", "many"]))
    if op == "truncate":
        return bytes(data[: draw(st.integers(0, max(0, len(data) - 1)))])
    if op == "append":
        return bytes(data) + draw(st.binary(min_size=1, max_size=16))
    if op == "splice":  # overwrite a run of bytes with random ones
        at = draw(st.integers(0, len(data) - 1))
        return bytes(data[:at]) + draw(st.binary(min_size=1, max_size=8)) + bytes(data[at + 8:])
    flips = 1 if op == "flip" else draw(st.integers(2, 8))
    for _ in range(flips):
        at = draw(st.integers(0, len(data) - 1))
        data[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(data)


VALID_ENCODINGS = st.one_of(
    st.sampled_from([encode_message(m) for m in EXAMPLES.values()]),
    MESSAGE_STRATEGY.map(encode_message),
)


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
        _decode_or_protocol_error(_raw(kind, vals))

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ


# --- envelopes -----------------------------------------------------------------------------------
def _fields(envelope: bytes) -> list:
    return msgpack.unpackb(envelope, raw=False)


def _repack(fields: list) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_seal_unseal_round_trip(kind):
    msg = EXAMPLES[kind]
    data = seal(ID, RUN, msg)
    max_bytes = max(MAX_SMALL, len(data))
    assert unseal(data, RUN, type(msg), max_bytes=max_bytes) == (ID.peer_id, msg)
    assert unseal(data, RUN, ALL, max_bytes=max_bytes, sender=ID.peer_id) == (ID.peer_id, msg)


def test_envelope_layout_and_freshness():
    before = time.time()
    data = seal(ID, RUN, EXAMPLES["ack"])
    version, run, sender, nonce, ts, body, sig = _fields(data)
    assert (version, run, sender, body) == (PROTOCOL_VERSION, RUN, ID.peer_id, encode_message(EXAMPLES["ack"]))
    assert len(nonce) == 16 and len(sig) == 64 and before <= ts <= time.time()
    assert _fields(seal(ID, RUN, EXAMPLES["ack"]))[3] != nonce  # a fresh nonce each time
    assert unseal(_repack([version, run, sender, nonce, ts, body, sig]), RUN, Ack)[1] == EXAMPLES["ack"]


@pytest.mark.parametrize("index", [3, 4, 5, 6])  # nonce, timestamp, body, signature
def test_unseal_rejects_tampering(index):
    fields = _fields(seal(ID, RUN, EXAMPLES["decision"]))
    value = fields[index]
    if isinstance(value, float):
        fields[index] = value + 1.0
    else:
        for bit in (0, 8 * len(value) - 1, 8 * (len(value) // 2) + 3):  # first, last, middle byte
            flipped = bytearray(value)
            flipped[bit // 8] ^= 1 << (bit % 8)
            fields[index] = bytes(flipped)
            with pytest.raises(ProtocolError, match="signature"):
                unseal(_repack(fields), RUN, Decision)
        fields[index] = value[:-1]
    with pytest.raises(ProtocolError, match="signature"):
        unseal(_repack(fields), RUN, Decision)


def test_unseal_rejects_forged_sender():
    fields = _fields(seal(ID, RUN, EXAMPLES["ack"]))
    fields[2] = OTHER.peer_id  # claims to come from OTHER, but ID signed it
    with pytest.raises(ProtocolError, match="signature"):
        unseal(_repack(fields), RUN, Ack)
    for bogus in ("", "not-a-peer-id", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "x" * 400):
        fields[2] = bogus
        with pytest.raises(ProtocolError):
            unseal(_repack(fields), RUN, Ack)


def test_unseal_rejects_another_run():
    data = seal(ID, RUN, EXAMPLES["join"])
    for other in ("run-other", RUN + " ", "", RUN.upper()):
        with pytest.raises(ProtocolError, match="run"):
            unseal(data, other, Join)
    fields = _fields(data)
    fields[1] = "run-other"  # re-labelled for another run: the signature no longer matches either
    with pytest.raises(ProtocolError):
        unseal(_repack(fields), "run-other", Join)


def test_unseal_rejects_other_sender():
    data = seal(ID, RUN, EXAMPLES["join"])
    assert unseal(data, RUN, Join, sender=ID.peer_id)[0] == ID.peer_id
    with pytest.raises(ProtocolError, match="sender"):
        unseal(data, RUN, Join, sender=OTHER.peer_id)
    # a reply signed by OTHER on a stream from ID is refused even though its signature is valid
    impostor = seal(OTHER, RUN, EXAMPLES["ack"])
    assert unseal(impostor, RUN, Ack)[0] == OTHER.peer_id
    with pytest.raises(ProtocolError, match="sender"):
        unseal(impostor, RUN, Ack, sender=ID.peer_id)


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, PROTOCOL_VERSION - 1, -1, 1 << 40, None, "1",
                                     b"\x01", True, float(PROTOCOL_VERSION), [PROTOCOL_VERSION]])
def test_unseal_rejects_other_version(version):
    fields = _fields(seal(ID, RUN, EXAMPLES["ack"]))
    assert unseal(_repack(fields), RUN, Ack)[1] == EXAMPLES["ack"]
    fields[0] = version
    with pytest.raises(ProtocolError, match="version"):
        unseal(_repack(fields), RUN, Ack)


def test_unseal_rejects_wrong_shape_and_types():
    fields = _fields(seal(ID, RUN, EXAMPLES["ack"]))
    for bad in (fields[:-1], fields + [b""], {"a": 1}, fields[0], []):
        with pytest.raises(ProtocolError):
            unseal(_repack(bad), RUN, Ack)
    for i, wrong in [(1, b"run"), (2, ID.peer_id.encode()), (3, "nonce"), (4, 5), (4, "5"), (5, "body"), (6, "sig")]:
        bad = list(fields)
        bad[i] = wrong
        with pytest.raises(ProtocolError, match="types"):
            unseal(_repack(bad), RUN, Ack)


def test_unseal_rejects_wrong_message_kind_and_size():
    data = seal(ID, RUN, EXAMPLES["ack"])
    with pytest.raises(ProtocolError, match="kind"):
        unseal(data, RUN, Join)
    reply = DecisionReply(decision=b"q" * 4000)
    body_len = len(encode_message(reply))
    big = seal(ID, RUN, reply)
    assert body_len < len(big) < body_len + 511
    assert unseal(big, RUN, DecisionReply, max_bytes=body_len)[1] == reply
    with pytest.raises(ProtocolError, match="envelope is"):
        unseal(big, RUN, DecisionReply, max_bytes=len(big) - 513)  # envelope over max_bytes + 512
    with pytest.raises(ProtocolError, match="message is"):
        unseal(big, RUN, DecisionReply, max_bytes=body_len - 1)  # envelope fits the slack, the body does not


def _unseal_or_protocol_error(data: bytes, **kwargs) -> object | None:
    try:
        return unseal(data, RUN, ALL, **kwargs)
    except ProtocolError:
        return None


def test_fuzz_unseal_garbage():
    tried = []

    @FUZZ
    @given(st.binary(max_size=400))
    def check(data):
        tried.append(data)
        _unseal_or_protocol_error(data)

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ


def test_fuzz_unseal_mutated_envelopes():
    sealed = st.one_of(
        st.sampled_from([seal(ID, RUN, m) for m in EXAMPLES.values() if len(encode_message(m)) < 400]),
        MESSAGE_STRATEGY.map(lambda m: seal(ID, RUN, m)),
    )
    tried, survived = [], []

    @FUZZ
    @given(_mutated(sealed))
    def check(data):
        tried.append(data)
        out = _unseal_or_protocol_error(data)
        if out is not None:
            survived.append(out)
            assert out[0] == ID.peer_id  # nothing but the true signer can ever come out

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ


def test_fuzz_unseal_structured():
    """Seven well-typed-ish fields with random contents, including random (valid-format) peer ids."""
    senders = st.one_of(
        st.sampled_from([ID.peer_id, OTHER.peer_id]),
        st.binary(min_size=32, max_size=32).map(peer_id_from_public_bytes),  # any 32 bytes as an Ed25519 key
        st.text(max_size=64),
    )
    bodies = st.one_of(VALID_ENCODINGS, st.binary(max_size=64))
    anything = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                         st.text(max_size=8), st.binary(max_size=8))
    tried = []

    @FUZZ
    @given(st.tuples(st.one_of(st.just(PROTOCOL_VERSION), anything), st.one_of(st.just(RUN), anything), senders,
                     st.one_of(st.binary(max_size=32), anything), st.one_of(st.floats(), anything), bodies,
                     st.one_of(st.binary(min_size=64, max_size=64), anything)))
    def check(fields):
        tried.append(fields)
        out = _unseal_or_protocol_error(_repack(list(fields)))
        assert out is None  # nobody here holds a key that signed these bytes

    check()
    print(f"fuzz inputs tried: {len(tried)}")
    assert len(tried) >= MIN_FUZZ


# --- DecisionBook --------------------------------------------------------------------------------
LEADER = Identity.generate()


def _decision(round_id: int, leader: str = LEADER.peer_id, status: str = "commit", **changes) -> Decision:
    base = dict(round=round_id, attempt=0, status=status, contributors=PEERS[:2], trainers=PEERS[:3],
                servers=[leader, PEERS[0]], leader=leader, sources=[leader], num_shards=1)
    base.update(changes)
    return Decision(**base)


def test_decision_book_accepts_leader_signed_commit():
    book = DecisionBook(RUN)
    decision = _decision(4)
    signed = seal(LEADER, RUN, decision)
    assert book.add(signed) == decision
    assert book.committed[4] == (signed, decision)
    assert book.latest() == 4
    assert book.add(signed) == decision  # the same decision again is harmless
    assert len(book.committed) == 1


def test_decision_book_rejects_retry():
    book = DecisionBook(RUN)
    with pytest.raises(ProtocolError, match="commit"):
        book.add(seal(LEADER, RUN, _decision(4, status="retry")))
    assert book.committed == {} and book.latest() == -2


def test_decision_book_rejects_decision_not_signed_by_its_leader():
    book = DecisionBook(RUN)
    with pytest.raises(ProtocolError, match="leader"):  # LEADER signs a decision naming OTHER as leader
        book.add(seal(LEADER, RUN, _decision(4, leader=OTHER.peer_id)))
    with pytest.raises(ProtocolError, match="leader"):  # OTHER signs a decision naming LEADER as leader
        book.add(seal(OTHER, RUN, _decision(4)))
    assert book.committed == {}


def test_decision_book_rejects_another_run_and_garbage():
    book = DecisionBook(RUN)
    with pytest.raises(ProtocolError):
        book.add(seal(LEADER, "run-other", _decision(4)))
    with pytest.raises(ProtocolError):
        book.add(seal(LEADER, RUN, EXAMPLES["ack"]))
    with pytest.raises(ProtocolError):
        book.add(b"\x00garbage")
    assert book.committed == {}


def test_decision_book_flags_conflicting_commit():
    book = DecisionBook(RUN)
    first = seal(LEADER, RUN, _decision(4))
    book.add(first)
    with pytest.raises(ProtocolError, match="conflicting"):
        book.add(seal(LEADER, RUN, _decision(4, contributors=PEERS[:1])))
    with pytest.raises(ProtocolError, match="conflicting"):  # another leader's commit for the same round
        book.add(seal(OTHER, RUN, _decision(4, leader=OTHER.peer_id)))
    assert book.committed[4][0] == first  # the first one is kept
    # the same decision re-signed (fresh nonce) is not a conflict
    assert book.add(seal(LEADER, RUN, _decision(4))) == _decision(4)
    book.add(seal(LEADER, RUN, _decision(5)))  # the next round is independent
    assert book.latest() == 5


def test_decision_book_membership_comes_from_previous_round():
    book = DecisionBook(RUN)
    assert book.membership(0) is None
    book.add(seal(LEADER, RUN, _decision(-1, trainers=PEERS[:1], servers=[LEADER.peer_id])))  # genesis
    assert book.membership(0) == Membership((PEERS[0],), (LEADER.peer_id,))
    assert book.membership(-1) is None and book.membership(1) is None
    book.add(seal(LEADER, RUN, _decision(0, trainers=PEERS[1:3], servers=[LEADER.peer_id, PEERS[3]])))
    assert book.membership(1) == Membership((PEERS[1], PEERS[2]), (LEADER.peer_id, PEERS[3]))
    assert book.membership(0) == Membership((PEERS[0],), (LEADER.peer_id,))


def test_decision_book_keeps_recent_rounds():
    book = DecisionBook(RUN, keep=2)
    for r in range(6):
        book.add(seal(LEADER, RUN, _decision(r)))
    assert sorted(book.committed) == [3, 4, 5]


def test_wait_membership_times_out_with_none():
    async def main():
        book = DecisionBook(RUN)
        book.add(seal(LEADER, RUN, _decision(2)))
        t0 = time.monotonic()
        got = await book.wait_membership(5, timeout_s=0.2)
        return got, time.monotonic() - t0

    got, elapsed = asyncio.run(main())
    assert got is None
    assert 0.15 <= elapsed < 2.0


def test_wait_membership_wakes_on_add():
    async def main():
        book = DecisionBook(RUN)
        book.add(seal(LEADER, RUN, _decision(2)))
        assert await book.wait_membership(3, timeout_s=0.01) is not None  # already known: immediate

        async def later():
            await asyncio.sleep(0.05)
            book.add(seal(LEADER, RUN, _decision(3)))  # an unrelated round first: the waiter keeps waiting
            await asyncio.sleep(0.05)
            book.add(seal(LEADER, RUN, _decision(4, trainers=PEERS[3:])))

        task = asyncio.create_task(later())
        t0 = time.monotonic()
        got = await book.wait_membership(5, timeout_s=5.0)
        await task
        return got, time.monotonic() - t0

    got, elapsed = asyncio.run(main())
    assert got == Membership((PEERS[3],), (LEADER.peer_id, PEERS[0]))
    assert elapsed < 2.0
