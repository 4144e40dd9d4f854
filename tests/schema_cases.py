"""Shared cases for the wire-protocol tests: an example per message kind, raw encoders, strategies.

Every malformed input must come out as a `ProtocolError` (never another exception type), and
every valid message must come back equal to what was sent.
"""

from __future__ import annotations

import dataclasses
import os
import typing

import msgpack
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import (
    MESSAGES,
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
    PunchInvite,
    PunchInviteReply,
    PunchReply,
    PunchRequest,
    Seal,
    ShardContribution,
    StateReply,
    StateRequest,
    encode_message,
)
from hypothesis import HealthCheck, settings
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
        Seal(decision=b"signed-decision", confirm=True),
        Claim(round=9, attempt=3, fence=True),
        ClaimReply(ok=False, decision=os.urandom(150)),
        ClaimReply(ok=False, decision=os.urandom(150), final=True),
        AggregateRequest(round=0, shard=4095, wait_s=0.0),
        AggregateShard(decision=b"d", shard=1, mode="mean", parts=[b"p1", b"p2"], clipped=PEERS[:1]),
        ContributionsRequest(round=4, attempt=1, shard=2, contributors=PEERS[:2]),
        Join(round=3, trains=True, serves=False),
        StateRequest(min_round=-1, direct=True),
        StateReply(round=-1, digest="ab" * 32, decision=b"", size=1000, direct_port=65535, direct_token=b"t" * 32,
                   direct_key=b"k" * 32, params_hash="c" * 16),
        StateReply(round=-1, digest="", decision=b"", size=0, busy=True),
        ManifestRequest(),
        ManifestReply(signed=b"manifest"),
        ProbeRequest(maddrs=["/ip4/192.0.2.1/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]),
        ProbeReply(reachable=True, address="192.0.2.1:4001"),
        PeerRecord(round=12, params_hash="f" * 64, role="volunteer", trains=True, serves=True,
                   maddrs=["/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4002"], reachability="public", loss=-1.5e-3,
                   bytes_sent=(1 << 62), updated=1.7e9, banned=PEERS[:1], rejected=3, scores=[f"{PEERS[0]}=+0.1"],
                   punched=PEERS[1:2], earlier_hashes=["11:" + "e" * 64], loss_round=11),
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


def _scalar_strategy(hint: type, meta: typing.Mapping) -> st.SearchStrategy:
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(min_value=meta["lo"], max_value=meta["hi"])
    if hint is float:
        return st.floats(min_value=meta["lo"], max_value=meta["hi"], allow_nan=False, allow_infinity=False)
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
