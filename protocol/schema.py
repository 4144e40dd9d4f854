"""Every message peers exchange, in one module: typed, versioned msgpack, decoded strictly.

A message is a frozen dataclass whose fields are ints, floats, bools, strs, bytes or lists of
those. On the wire it is `[kind, [field values...]]`, wrapped in a signed `Envelope`. Decoding
checks sizes before allocating (msgpack limits derived from the caller's byte budget), then
every field's type and bound; any failure is a `ProtocolError` naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
from groundswell.compression.wire_bounds import count_objects
from groundswell.compression.wire_pack import pack

PROTOCOL_VERSION = 18  # 2: claims carry `fence`; the state follows its reply as a raw trailer; 3: envelopes sign the
# body's sha256; 4: payload wire version 2 (sparseloco's Elias-Fano indices), so mixed peers refuse each other up front,
# and BLAKE3 instead of SHA-256 for bulk hashes (envelope bodies, contribution digests, the state blob); 5: state
# requests and replies may move the blob over a direct TCP connection; 6: that blob is sealed (AES-256-GCM, the key in the
# signed reply), and closed runs use it too; 7: small requests (`UNARY_MAX_REQUEST`) travel as libp2p unary calls
# (their own protocol names), not one stream each; 8: hole punching (`punch`, `punch-invite`), peer records list
# the peers reached by a punch; 9: the coordinator's record lists its hashes of earlier rounds; 10: a state reply
# names the state's parameter hash (a joiner refuses a state the coordinator contradicts before downloading it); 11:
# that hash, and the one peer records publish, also covers DiLoCo's outer momentum buffer (peers' hashes would differ);
# 12: a state reply may say `busy` (the server's upload slots are taken: ask again later), not "nothing newer"; 13: a
# leader confirms its commit at the peers that sealed it before announcing it (`Seal.confirm`), and a claim reply
# says whether the commit it carries is final (`ClaimReply.final`); 14: the published state hash also covers the commit
# before the state, and a dense mean's shard says by how much it clipped each contributor it names (`weights`); 15:
# clipping's reference is the median of the non-zero norms, and a peer record expires at its signed time plus its TTL;
# 16: a peer record names the round its loss was measured after (`loss_round`); 17: a contribution's norm for clipping
# is summed by another fixed tree (contiguous halves), and a dense codec's zeros are in it; 18: the published state hash
# has all 256 bits (64 hex digits), not 64
MAX_ID = 128  # peer ids, run ids, reasons and other short strings
MAX_LIST = 4096  # peer lists, shard lists
MAX_SMALL = 1 << 20  # a control message never needs more than this


class ProtocolError(ValueError):
    """A message is malformed, of the wrong kind, or breaks a bound; the message says which.

    `reason` is the short class it is counted under ("malformed", "bad-signature", "replayed",
    ...); `strike`: whether it counts against the sender (an honest peer never sends it)."""

    def __init__(self, message: str = "", *, reason: str = "malformed", strike: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.strike = strike


def _f(max_len: int = MAX_ID, max_items: int = MAX_LIST, lo: float | None = None, hi: float | None = None,
       **default: Any) -> Any:
    # `default=` only spares Python callers a field; on the wire every field is always present
    return field(metadata={"max_len": max_len, "max_items": max_items, "lo": lo, "hi": hi}, **default)


_ROUND = dict(lo=0, hi=1 << 40)


@dataclass(frozen=True)
class Message:
    """Base of all messages; `KIND` is the wire tag."""

    KIND: ClassVar[str] = ""


# --- the round ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardContribution(Message):
    """A contributor's payloads for one shard (a run of segments) of round/attempt."""

    KIND: ClassVar[str] = "contribute"
    round: int = _f(**_ROUND)
    attempt: int = _f(lo=0, hi=1 << 20)
    shard: int = _f(lo=0, hi=MAX_LIST)
    first_segment: int = _f(lo=0, hi=1 << 20)
    segments: list[bytes] = _f(max_len=1 << 34)  # one encoded Payload per segment of the shard


@dataclass(frozen=True)
class Ack(Message):
    """Yes or no, with a reason a person can read."""

    KIND: ClassVar[str] = "ack"
    ok: bool = _f()
    reason: str = _f(max_len=512)


@dataclass(frozen=True)
class HaveReport(Message):
    """Aggregator to leader: the contributors whose whole shard it holds for round/attempt."""

    KIND: ClassVar[str] = "have"
    round: int = _f(**_ROUND)
    attempt: int = _f(lo=0, hi=1 << 20)
    shard: int = _f(lo=0, hi=MAX_LIST)
    contributors: list[str] = _f()
    # digest of each contributor's shard (parallel to contributors): what a commit pins down
    digests: list[bytes] = field(default_factory=list, metadata={"max_len": 32, "max_items": MAX_LIST, "lo": None,
                                                                 "hi": None})
    # peers whose contribution this aggregator refused as invalid: the leader stops waiting for them
    refused: list[str] = field(default_factory=list, metadata={"max_len": MAX_ID, "max_items": MAX_LIST, "lo": None,
                                                               "hi": None})


@dataclass(frozen=True)
class Decision(Message):
    """The leader's verdict on round/attempt, and who takes part in the next round.

    status "commit": the aggregate is the mean over exactly `contributors`; "retry": nothing is
    applied and the round runs again as attempt+1. `trainers`/`servers` are the membership the
    next round (or attempt) is planned from."""

    KIND: ClassVar[str] = "decision"
    round: int = _f(lo=-1, hi=1 << 40)
    attempt: int = _f(lo=0, hi=1 << 20)
    status: str = _f(max_len=16)
    contributors: list[str] = _f()
    trainers: list[str] = _f()
    servers: list[str] = _f()
    leader: str = _f()
    sources: list[str] = _f()  # the aggregator whose copy of shard s counts
    num_shards: int = _f(lo=0, hi=MAX_LIST)
    # The leader's wall clock when it decided: a commit opens the next round's attempt slots.
    time: float = field(default=0.0, metadata={"max_len": 0, "max_items": 0, "lo": 0.0, "hi": 1e12})
    # The digest of every contribution that counts, shard-major in contributor order: an aggregate
    # is accepted only with exactly these, so a contributor that sent different aggregators
    # different versions cannot make peers apply different sums.
    digests: list[bytes] = field(default_factory=list, metadata={"max_len": 32, "max_items": 1 << 16, "lo": None,
                                                                 "hi": None})


@dataclass(frozen=True)
class DecisionRequest(Message):
    """Contributor to leader (or anyone): the decision of round/attempt, waiting up to wait_s."""

    KIND: ClassVar[str] = "get-decision"
    round: int = _f(**_ROUND)
    attempt: int = _f(lo=0, hi=1 << 20)
    wait_s: float = _f(lo=0, hi=3600)


@dataclass(frozen=True)
class DecisionReply(Message):
    """A signed decision (the leader's envelope bytes), or empty bytes if none is known yet."""

    KIND: ClassVar[str] = "decision-reply"
    decision: bytes = _f(max_len=MAX_SMALL)


@dataclass(frozen=True)
class Seal(Message):
    """Leader to aggregator: build your shard's aggregate for this commit (signed bytes), or, with
    the leader's retry decision of the attempt, drop the commit it sealed here."""

    KIND: ClassVar[str] = "seal"
    decision: bytes = _f(max_len=MAX_SMALL)
    # the same commit again, before the leader announces it: refused if a later attempt's claim
    # fenced it off here since; else later claimers are told it is final
    confirm: bool = _f(default=False)


@dataclass(frozen=True)
class Claim(Message):
    """Leader to the round's other leaders (then earlier attempts' leaders and aggregators): may I decide
    round/attempt?"""

    KIND: ClassVar[str] = "claim"
    round: int = _f(**_ROUND)
    attempt: int = _f(lo=0, hi=1 << 20)
    fence: bool = _f()  # if no objection: refuse earlier attempts' claims and seals from now on


@dataclass(frozen=True)
class ClaimReply(Message):
    """`ok`: no objection (this peer has not let another leader decide this attempt); `decision`:
    a commit of the round this peer already knows (the claimer adopts it), or empty; `final`: that
    commit was announced, or its leader confirmed it here (it must not be decided otherwise)."""

    KIND: ClassVar[str] = "claim-reply"
    ok: bool = _f()
    decision: bytes = _f(max_len=MAX_SMALL)
    final: bool = _f(default=False)


@dataclass(frozen=True)
class AggregateRequest(Message):
    """The aggregate of one shard of a committed round."""

    KIND: ClassVar[str] = "get-aggregate"
    round: int = _f(**_ROUND)
    shard: int = _f(lo=0, hi=MAX_LIST)
    wait_s: float = _f(lo=0, hi=3600)


@dataclass(frozen=True)
class AggregateShard(Message):
    """One shard of a committed round: the signed decision and, per segment, either the mean
    (dense codecs, one payload) or every contributor's payload in decision order (sparse)."""

    KIND: ClassVar[str] = "aggregate"
    decision: bytes = _f(max_len=MAX_SMALL)
    shard: int = _f(lo=0, hi=MAX_LIST)
    mode: str = _f(max_len=16)
    parts: list[bytes] = _f(max_len=1 << 34)  # contributors or segments: MAX_LIST at most either way
    clipped: list[str] = field(default_factory=list, metadata={"max_len": MAX_ID, "max_items": MAX_LIST,
                                                               "lo": None, "hi": None})  # "mean": whose norm was clipped
    # "mean": the factor each of those entered the mean with (their error feedback keeps the rest)
    weights: list[float] = field(default_factory=list, metadata={"max_len": 0, "max_items": MAX_LIST, "lo": 0.0,
                                                                 "hi": 1.0})


@dataclass(frozen=True)
class ContributionsRequest(Message):
    """A leader asks a shard's source for these contributors' signed contributions (to score them)."""

    KIND: ClassVar[str] = "get-contributions"
    round: int = _f(**_ROUND)
    attempt: int = _f(lo=0, hi=1 << 20)
    shard: int = _f(lo=0, hi=MAX_LIST)
    contributors: list[str] = _f()


@dataclass(frozen=True)
class Join(Message):
    """A peer asks the leader of a round to be planned in from the next round on."""

    KIND: ClassVar[str] = "join"
    round: int = _f(**_ROUND)
    trains: bool = _f()
    serves: bool = _f()


# --- state ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateRequest(Message):
    """A joiner or straggler asks for the current global state."""

    KIND: ClassVar[str] = "get-state"
    min_round: int = _f(lo=-1, hi=1 << 40)
    direct: bool = _f(default=False)  # the requester would rather fetch the blob over a direct TCP connection


@dataclass(frozen=True)
class StateReply(Message):
    """The global state after round `round - 1`: `size` bytes of serialized tensors follow this
    reply as a raw trailer, and their BLAKE3 digest (hex) is `digest`; `decision` is the signed decision of
    round `round - 1` (which plans round `round`). Size 0: unavailable. With `direct_port`, the
    trailer is empty and the blob is fetched once over TCP from that port of the same host, by
    presenting `direct_token`, sealed under `direct_key` (see `protocol/direct.py`). Size 0 with
    `busy`: the server is uploading its state to as many peers as it takes at once; ask later."""

    KIND: ClassVar[str] = "state"
    round: int = _f(lo=-1, hi=1 << 40)
    digest: str = _f(max_len=64)
    decision: bytes = _f(max_len=MAX_SMALL)
    size: int = _f(lo=0, hi=1 << 38)
    direct_port: int = _f(lo=0, hi=65535, default=0)  # 0: the blob is the trailer
    direct_token: bytes = _f(max_len=32, default=b"")
    direct_key: bytes = _f(max_len=32, default=b"")  # AES-256-GCM key of the sealed blob
    # hash of the state (parameters, and DiLoCo's momentum): checked against the swarm's published
    # hashes before the blob is read, and against the blob once it is
    params_hash: str = _f(max_len=64, default="")
    busy: bool = _f(default=False)


@dataclass(frozen=True)
class ManifestRequest(Message):
    """Ask any peer for the run's signed manifest."""

    KIND: ClassVar[str] = "get-manifest"


@dataclass(frozen=True)
class ManifestReply(Message):
    """The signed manifest bytes (verified by the receiver against the coordinator's key)."""

    KIND: ClassVar[str] = "manifest"
    signed: bytes = _f(max_len=MAX_SMALL)


@dataclass(frozen=True)
class ProbeRequest(Message):
    """Ask a public peer to dial these addresses of ours back (plain TCP connect, nothing sent)."""

    KIND: ClassVar[str] = "probe"
    maddrs: list[str] = _f(max_len=256, max_items=8)


@dataclass(frozen=True)
class ProbeReply(Message):
    """Whether one of the addresses accepted a connection from the prober, and which."""

    KIND: ClassVar[str] = "probe-reply"
    reachable: bool = _f()
    address: str = _f(max_len=256)


@dataclass(frozen=True)
class PunchRequest(Message):
    """A peer behind a NAT asks a rendezvous peer to set up a hole punch to `target`."""

    KIND: ClassVar[str] = "punch"
    target: str = _f()


@dataclass(frozen=True)
class PunchReply(Message):
    """The rendezvous' answer: where to dial `target` (a TCP multiaddr it saw it at), or why not."""

    KIND: ClassVar[str] = "punch-reply"
    ok: bool = _f()
    reason: str = _f(max_len=256)
    address: str = _f(max_len=256)


@dataclass(frozen=True)
class PunchInvite(Message):
    """From a rendezvous peer: `dialer`, seen at `address`, is about to dial us; open our NAT to it."""

    KIND: ClassVar[str] = "punch-invite"
    dialer: str = _f()
    address: str = _f(max_len=256)


@dataclass(frozen=True)
class PunchInviteReply(Message):
    """Whether the invited peer sent its punch (its NAT is open to the dialer for a few seconds)."""

    KIND: ClassVar[str] = "punch-invite-reply"
    ok: bool = _f()
    reason: str = _f(max_len=256)


@dataclass(frozen=True)
class PeerRecord(Message):
    """What a peer publishes in the DHT about itself, refreshed every few seconds."""

    KIND: ClassVar[str] = "peer"
    round: int = _f(lo=-1, hi=1 << 40)
    params_hash: str = _f(max_len=64)  # of the shared outer state it holds: parameters (+ DiLoCo's momentum)
    role: str = _f(max_len=16)  # "coordinator" or "volunteer"
    trains: bool = _f()
    serves: bool = _f()
    maddrs: list[str] = _f(max_len=256, max_items=32)
    reachability: str = _f(max_len=64)
    loss: float = _f()
    bytes_sent: int = _f(lo=0, hi=1 << 62)
    updated: float = _f(lo=0)
    banned: list[str] = field(default_factory=list, metadata={"max_len": MAX_ID, "max_items": 32, "lo": None,
                                                              "hi": None})  # peers this one refuses now
    rejected: int = field(default=0, metadata={"max_len": 0, "max_items": 0, "lo": 0, "hi": 1 << 62})  # messages refused
    scores: list[str] = field(default_factory=list, metadata={"max_len": 192, "max_items": 64, "lo": None,
                                                              "hi": None})  # "peer=score" of its last scored round
    punched: list[str] = field(default_factory=list, metadata={"max_len": MAX_ID, "max_items": 64, "lo": None,
                                                               "hi": None})  # peers it reached by a hole punch
    # "round:hash" of the rounds before `round` (the coordinator's: joiners check states against it)
    earlier_hashes: list[str] = field(default_factory=list, metadata={"max_len": 96, "max_items": 16, "lo": None,
                                                                       "hi": None})
    # the round `loss` was measured after (-1: no loss yet); `round` runs ahead of it between evaluations
    loss_round: int = field(default=-1, metadata={"max_len": 0, "max_items": 0, "lo": -1, "hi": 1 << 40})


MESSAGES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        ShardContribution, Ack, HaveReport, Decision, DecisionRequest, DecisionReply, Seal, Claim, ClaimReply,
        AggregateRequest, AggregateShard, ContributionsRequest, Join,
        StateRequest, StateReply, ManifestRequest, ManifestReply, ProbeRequest, ProbeReply, PeerRecord,
        PunchRequest, PunchReply, PunchInvite, PunchInviteReply,
    )
}


def encode_message(msg: Message) -> bytes:
    """Serialize a message as `[kind, [values...]]`."""
    return pack([msg.KIND, [getattr(msg, f.name) for f in dataclasses.fields(msg)]])


def decode_message(data: bytes, expect: type[Message] | tuple[type[Message], ...], max_bytes: int = MAX_SMALL) -> Any:
    """Strictly parse a message of one of the expected types."""
    expected = expect if isinstance(expect, tuple) else (expect,)
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("message must be bytes")
    if len(data) > max_bytes:
        raise ProtocolError(f"message is {len(data)} bytes, over the limit of {max_bytes}")
    data = bytes(data)
    try:
        count_objects(data, _most_objects(expected))  # before msgpack builds any of them
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, max_bin_len=len(data),
            max_str_len=min(len(data), 1 << 16), max_array_len=min(len(data), 1 << 20), max_map_len=0, max_ext_len=0,
        )
    except MemoryError:  # ours, not the sender's fault: no strike for it
        raise
    except Exception as exc:  # msgpack raises many unrelated types on bad input
        raise ProtocolError(f"not a valid msgpack message: {exc}") from None
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], list)):
        raise ProtocolError("a message must be [kind, [fields]]")
    kind, values = obj
    cls = MESSAGES.get(kind)
    if cls is None or cls not in expected:
        raise ProtocolError(f"unexpected message kind {brief(kind)}; expected {[c.KIND for c in expected]}")
    fields, hints = _layout(cls)
    if len(values) != len(fields):
        raise ProtocolError(f"{kind}: expected {len(fields)} fields, got {len(values)}")
    return cls(**{f.name: _check(hints[f.name], v, f, kind) for f, v in zip(fields, values)})


@functools.cache
def _most_objects(expected: tuple[type[Message], ...]) -> int:
    """The most msgpack objects a message of the expected kinds can hold: [kind, [fields]], each
    field a scalar or a list of at most `max_items` scalars."""
    def most(cls: type[Message]) -> int:
        fields, hints = _layout(cls)
        lists = sum(f.metadata["max_items"] for f in fields if typing.get_origin(hints[f.name]) is list)
        return 3 + len(fields) + lists

    return max(most(cls) for cls in expected)


def brief(value: Any) -> str:
    """A value from the wire, quoted for an error message at a bounded length."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


@functools.cache
def _layout(cls: type) -> tuple[tuple[dataclasses.Field, ...], dict[str, Any]]:
    """A message class's fields and resolved type hints (resolving them per message cost the
    network thread ~2% of its time in a SparseLoCo swarm)."""
    return dataclasses.fields(cls), typing.get_type_hints(cls)


def _check(hint: Any, value: Any, f: dataclasses.Field, kind: str) -> Any:
    where = f"{kind}.{f.name}"
    meta = f.metadata
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or len(value) > meta["max_items"]:
            raise ProtocolError(f"{where} must be a list of at most {meta['max_items']} items")
        return [_scalar(item, v, meta, where) for v in value]
    return _scalar(hint, value, meta, where)


def _scalar(hint: Any, value: Any, meta: Any, where: str) -> Any:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif hint in (str, bytes):
        ok = isinstance(value, hint) and len(value) <= meta["max_len"]
    else:
        raise ProtocolError(f"{where}: unsupported field type {hint!r}")
    if not ok:
        raise ProtocolError(f"{where} must be a {hint.__name__}" + (" of bounded size" if hint in (str, bytes) else ""))
    if hint in (int, float):
        if (meta["lo"] is not None and value < meta["lo"]) or (meta["hi"] is not None and value > meta["hi"]):
            raise ProtocolError(f"{where}={value} is out of range [{meta['lo']}, {meta['hi']}]")
    return value
