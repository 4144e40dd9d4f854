"""Allowlisted runs: only listed peers contribute or join as trainers; others may download the
state only if the manifest says so. Refusals are counted and strike the sender."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from blake3 import blake3
from groundswell.protocol.envelope import seal, unseal
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Ack, Join, ShardContribution, StateReply, StateRequest

sys.path.insert(0, str(Path(__file__).parent))
from inproc_harness import RUN, frame, make_target


@pytest.fixture
def closed_run():
    yield from make_target(allowlisted=2, open_state=False)


@pytest.fixture
def closed_run_open_state():
    yield from make_target(allowlisted=2, open_state=True)


def _ask(t, handler: str, who: Identity, msg, reply_type):
    return _ask_with_trailer(t, handler, who, msg, reply_type)[0]


def _ask_with_trailer(t, handler: str, who: Identity, msg, reply_type):
    """The signed reply, and the raw frame after it (b"" if none)."""
    out = t.feed(handler, who.peer_id, frame(seal(who, RUN, msg)))
    assert out, f"{handler} was not answered"
    n = int.from_bytes(out[:8], "big")
    reply = unseal(out[8:8 + n], RUN, reply_type, sender=t.me.peer_id)[1]
    rest = out[8 + n:]
    trailer = rest[8:8 + int.from_bytes(rest[:8], "big")] if rest else b""
    assert len(rest) == (8 + len(trailer) if rest else 0), "bytes after the frames"
    return reply, trailer


def _contribution(t) -> ShardContribution:
    payload = t.ctx.codec.encode(torch.randn(t.ctx.segment_numels[0])).to_bytes()
    return ShardContribution(0, 0, 0, 0, [payload])


def test_only_listed_peers_contribute_or_join(closed_run):
    t = closed_run
    listed, stranger = t.peers[0], Identity.generate()
    assert _ask(t, "contribute", listed, _contribution(t), Ack).ok
    # a stranger's contribution is turned away before a byte of it is read (its stream closed
    # unanswered: it may be large); `join`, which it sends first, says why in words
    assert t.feed("contribute", stranger.peer_id, frame(seal(stranger, RUN, _contribution(t)))) == b""
    assert not _ask(t, "join", stranger, Join(0, True, False), Ack).ok  # as a trainer
    # nor as neither (a leave is a member's; since 2026-12-07: strangers' filled a round's join table)
    refused = _ask(t, "join", stranger, Join(0, False, False), Ack)
    assert not refused.ok and "not a member" in refused.reason
    # nor as a server: it would lead attempts (sign commits) and build means in the next round
    refused = _ask(t, "join", stranger, Join(0, False, True), Ack)
    assert not refused.ok and "not allowed to serve" in refused.reason
    assert _ask(t, "join", listed, Join(0, False, True), Ack).ok
    assert stranger.peer_id not in t.server.joins[0]
    assert t.server.joins[0][listed.peer_id] == (False, True)
    held = t.server.attempts[(0, 0)].contributions[0]
    assert set(held) == {listed.peer_id}
    assert t.node.guard.rejected["unauthorized:contribute"] == 1 and t.node.guard.rejected["unauthorized:join"] == 3


def test_a_closed_runs_coordinator_serves_whether_or_not_the_allowlist_names_it():
    from dataclasses import replace

    from groundswell.compression import make_codec
    from groundswell.peer.run_state import RunContext

    coordinator, listed, stranger = (Identity.generate().peer_id for _ in range(3))
    ctx = RunContext("r", 1, 5.0, 1.0, 1, (4096,), make_codec("fp32"), 1 << 20, frozenset({listed}),
                     coordinator=coordinator)
    assert ctx.may_serve(coordinator) and ctx.may_serve(listed) and not ctx.may_serve(stranger)
    assert not ctx.authorized(coordinator)  # serving is not contributing
    assert not replace(ctx, coordinator="").may_serve(coordinator)
    assert replace(ctx, allowlist=None).may_serve(stranger)  # an open run: anyone


def test_state_is_only_for_listed_peers_unless_the_manifest_opens_it(closed_run, closed_run_open_state):
    stranger = Identity.generate()
    closed, blob = _ask_with_trailer(closed_run, "get-state", stranger, StateRequest(-1), StateReply)
    assert closed.size == 0 and blob == b"" and closed_run.node.guard.rejected["unauthorized:get-state"] == 1
    for run, who in ((closed_run, closed_run.peers[1]), (closed_run_open_state, stranger)):
        reply, blob = _ask_with_trailer(run, "get-state", who, StateRequest(-1), StateReply)
        assert reply.round == 0 and reply.size == len(blob) > 0
        assert blake3(blob).hexdigest() == reply.digest  # the reply vouches for the blob by its BLAKE3 digest


def test_a_strangers_seal_is_refused_unread_in_a_closed_run_and_counted_in_an_open_one(closed_run):
    # Found by a review: any identity could make a peer decode a megabyte of commit per `seal`
    # request, unrefused and uncounted, before it asked whether the sender leads anything.
    import os

    from groundswell.protocol.schema import Decision, Seal

    stranger = Identity.generate()
    commit = Decision(0, 0, "commit", [], [], [], stranger.peer_id, [], 16, 1.0, [os.urandom(16) for _ in range(5000)])
    request = frame(seal(stranger, RUN, Seal(seal(stranger, RUN, commit))))
    assert closed_run.feed("seal", stranger.peer_id, request) == b""  # closed unanswered, its body unread
    assert closed_run.node.guard.rejected["unauthorized:seal"] == 1
    gen = make_target()
    open_run = next(gen)
    try:
        out = open_run.feed("seal", stranger.peer_id, request)
        assert not unseal(out[8:], RUN, Ack)[1].ok
        assert open_run.node.guard.rejected["not-leader:seal"] == 1
    finally:
        next(gen, None)
