"""Hole punching without NATs (with NATs: test_netlab.py): the rendezvous, punch_through, the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import pytest
from groundswell.peer import holepunch
from groundswell.peer.holepunch import Rendezvous, observed_address
from groundswell.peer.punch_scheduler import PunchScheduler
from groundswell.protocol.schema import PeerRecord, PunchInvite, PunchInviteReply, PunchReply, PunchRequest
from groundswell.protocol.transport import PeerUnavailable

pytestmark = pytest.mark.timeout(60)


@dataclass
class Info:
    peer_id: str
    addrs: list[str]


@dataclass
class FakeP2P:
    peers: list[Info]

    async def list_peers(self) -> list[Info]:
        return self.peers


@dataclass
class FakeTransport:
    answer: object = None  # a PunchInviteReply, or an exception to raise
    calls: list = field(default_factory=list)

    async def request(self, peer, handler, msg, expect, *, timeout_s):
        self.calls.append((peer, handler, msg))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


D_AT, T_AT = "/ip4/10.99.0.21/tcp/4001", "/ip4/10.99.0.22/tcp/4002"


def _rendezvous(answer) -> tuple[Rendezvous, FakeTransport]:
    t = FakeTransport(answer)
    peers = [Info("dialer", [D_AT]), Info("target", [T_AT]),
             Info("relayed", ["/ip4/10.99.0.10/tcp/40000/p2p/X/p2p-circuit"])]
    return Rendezvous(FakeP2P(peers), t), t


def test_the_rendezvous_gives_each_side_the_address_it_sees_the_other_at():
    rdv, t = _rendezvous(PunchInviteReply(True, ""))
    reply = asyncio.run(rdv.handle("dialer", PunchRequest("target")))
    assert reply.ok and reply.address == T_AT
    assert t.calls == [("target", "punch-invite", PunchInvite("dialer", D_AT))]
    assert rdv.served == 1


def test_the_rendezvous_limits_each_pair_not_each_requester():
    rdv, t = _rendezvous(PunchInviteReply(True, ""))

    async def go():
        first = await rdv.handle("dialer", PunchRequest("target"))
        again = await rdv.handle("dialer", PunchRequest("target"))
        other = await rdv.handle("dialer", PunchRequest("relayed"))
        return first, again, other

    first, again, other = asyncio.run(go())
    assert first.ok and not again.ok and again.reason == "rate limited"
    assert not other.ok and other.reason != "rate limited"
    assert len(t.calls) == 1


@pytest.mark.parametrize("sender,target,answer,reason", [
    ("dialer", "relayed", PunchInviteReply(True, ""), "no direct connection to the target"),
    ("stranger", "target", PunchInviteReply(True, ""), "no direct connection to the requester"),
    ("dialer", "dialer", PunchInviteReply(True, ""), "target is the requester"),
    ("dialer", "target", PunchInviteReply(False, "busy"), "target declined: busy"),
    ("dialer", "target", PeerUnavailable("gone"), "target unreachable: gone"),
])
def test_the_rendezvous_says_why_it_cannot_introduce(sender, target, answer, reason):
    rdv, _ = _rendezvous(answer)
    reply = asyncio.run(rdv.handle(sender, PunchRequest(target)))
    assert not reply.ok and reply.reason == reason and reply.address == ""


def test_observed_address_skips_relayed_connections():
    peers = [Info("a", ["/ip4/1.2.3.4/tcp/10/p2p-circuit"]), Info("b", ["/ip4/1.2.3.5/tcp/11"])]
    assert observed_address(peers, "a") is None and observed_address(peers, "b") == "/ip4/1.2.3.5/tcp/11"


@dataclass
class FakeClient:
    dialled: list = field(default_factory=list)

    async def connect(self, peer, maddrs):
        self.dialled.append((str(peer), [str(m) for m in maddrs]))


@pytest.mark.parametrize("addrs,ok", [(["/ip4/10.99.0.22/tcp/4002"], True),
                                      (["/ip4/10.99.0.10/tcp/40000/p2p/X/p2p-circuit"], False)])
def test_a_punch_counts_only_if_a_direct_connection_came_of_it(addrs, ok):
    from groundswell.protocol.identity import Identity

    target = Identity.generate().peer_id
    p2p = FakeP2P([Info(target, addrs)])
    p2p._client = FakeClient()
    transport = FakeTransport(PunchReply(True, "", T_AT))

    async def go():
        return await holepunch.punch_through(p2p, transport, "rdv", target)

    if ok:
        assert asyncio.run(go()) == T_AT
    else:
        with pytest.raises(holepunch.PunchFailed, match="relay"):
            asyncio.run(go())
    assert p2p._client.dialled == [(target, [T_AT])]


def test_a_failing_pass_does_not_end_the_scheduler():
    sched = PunchScheduler("m", ["rdv"], None, None, dict)
    calls = []

    async def failing(attempts):
        calls.append(1)
        raise OSError("the daemon's control socket is gone")

    sched.start_due = failing  # type: ignore[method-assign]

    async def go():
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await sched.run(every_s=0.01)

    asyncio.run(go())
    assert len(calls) >= 3


def _rec(reach: str) -> PeerRecord:
    return PeerRecord(0, "", "volunteer", True, False, [], reach, 0.0, 0, 0.0)


def test_a_volunteer_punches_to_nated_peers_with_larger_ids_and_backs_off_after_a_failure(monkeypatch):
    tried: list[tuple[str, str]] = []
    outcome = {"m-later": holepunch.PunchFailed("timed out")}

    async def fake_punch(p2p, transport, rdv, target, scopes=None):
        assert scopes == frozenset({"public"})  # the run's, for the address the rendezvous gives
        tried.append((rdv, target))
        if target in outcome:
            raise outcome[target]
        return "/ip4/10.99.0.22/tcp/4002"

    monkeypatch.setattr(holepunch, "punch_through", fake_punch)
    records = {"a-smaller": _rec("private"), "m-later": _rec("private"), "n-direct": _rec("private"),
               "o-public": _rec("public"), "p-ok": _rec("private")}
    p2p = FakeP2P([Info("n-direct", ["/ip4/10.99.0.23/tcp/1"])])
    sched = PunchScheduler("m", ["rdv1", "rdv2"], p2p, None, lambda: records)
    sched.scopes = frozenset({"public"})
    told: list[tuple[str, str]] = []
    sched.announce = lambda peer, address: told.append((peer, address))

    asyncio.run(sched.once())
    assert told == [("p-ok", "/ip4/10.99.0.22/tcp/4002")]  # once, for the first punch that worked
    # m-later failed at both rendezvous peers; p-ok worked at the first; nothing else was tried
    assert tried == [("rdv1", "m-later"), ("rdv2", "m-later"), ("rdv1", "p-ok")]
    assert [(a["peer"], a["ok"]) for a in sched.attempts] == [("m-later", False), ("p-ok", True)]
    assert sched.punched() == ["p-ok"]
    assert "timed out" in sched.attempts[0]["reason"]
    tried.clear()
    asyncio.run(sched.once())
    assert tried == []  # a failed pair waits RETRY_S, a connected one 30 s
    sched._next = {k: 0.0 for k in sched._next}
    asyncio.run(sched.attempt("p-ok"))
    assert len(told) == 1  # a second punch that works is not announced again
    asyncio.run(sched.attempt("m-later"))
    assert sched._next["m-later"] - time.monotonic() > 2 * PunchScheduler.RETRY_S - 5  # doubled


def test_a_slow_punch_holds_up_neither_the_next_pass_nor_a_peer_that_shows_up_later(monkeypatch):
    """A symmetric NAT's dial takes ~10 s to time out: a cone-NAT peer whose record arrives
    meanwhile is punched to at the next pass, and the slow pair is not tried twice at once."""
    tried: list[str] = []
    slow_started = asyncio.Event()

    async def fake_punch(p2p, transport, rdv, target, scopes=None):
        tried.append(target)
        if target == "m-symmetric":
            slow_started.set()
            await asyncio.sleep(3600)
        return "/ip4/10.99.0.22/tcp/4002"

    monkeypatch.setattr(holepunch, "punch_through", fake_punch)
    records = {"m-symmetric": _rec("private")}
    sched = PunchScheduler("m", ["rdv"], FakeP2P([]), None, lambda: records)

    async def go():
        runner = asyncio.create_task(sched.run(every_s=0.01))
        try:
            await asyncio.wait_for(slow_started.wait(), 5)
            records["p-cone"] = _rec("private")  # its record arrives while the slow punch runs
            async with asyncio.timeout(5):
                while not sched.attempts:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # a few more passes
        finally:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner

    asyncio.run(go())
    assert tried == ["m-symmetric", "p-cone"]  # each once: the slow one is still running
    assert [(a["peer"], a["ok"]) for a in sched.attempts] == [("p-cone", True)]
    assert sched._trying == set()  # cancelled with the scheduler, nothing left marked running


def test_a_punch_that_works_while_the_next_pass_lists_connections_stays_known(monkeypatch):
    """Attempts run during a pass's own awaits: one that works while the connection list is being
    read (the list from before its connection) must not be dropped from `direct` by that pass."""
    punch_may_end = asyncio.Event()

    async def fake_punch(p2p, transport, rdv, target, scopes=None):
        await punch_may_end.wait()
        return "/ip4/10.99.0.22/tcp/4002"

    monkeypatch.setattr(holepunch, "punch_through", fake_punch)
    sched = None

    class SlowList:
        calls = 0

        async def list_peers(self):
            SlowList.calls += 1
            if SlowList.calls == 2:  # the second pass: the punch ends while we read the list
                punch_may_end.set()
                while "p-cone" not in sched.direct:
                    await asyncio.sleep(0)
            return []  # read before the punched connection showed up

    sched = PunchScheduler("m", ["rdv"], SlowList(), None, lambda: {"p-cone": _rec("private")})

    async def go():
        async with asyncio.TaskGroup() as attempts:
            await sched.start_due(attempts)
            await sched.start_due(attempts)

    asyncio.run(go())
    assert sched.punched() == ["p-cone"]


def test_the_rendezvous_introduces_only_nated_peers_of_the_run():
    t = FakeTransport(PunchInviteReply(True, ""))
    asked: list[tuple[str, ...]] = []

    async def members(ids):
        asked.append(ids)
        return "stranger" not in ids

    rdv = Rendezvous(FakeP2P([Info("dialer", [D_AT]), Info("target", [T_AT]), Info("stranger", [D_AT])]), t, members)
    refused = asyncio.run(rdv.handle("stranger", PunchRequest("target")))
    assert not refused.ok and "NAT'ed peers of this run" in refused.reason and refused.address == ""
    assert t.calls == []  # the target was never bothered
    assert asyncio.run(rdv.handle("dialer", PunchRequest("target"))).ok
    assert asked == [("stranger", "target"), ("dialer", "target")]


def test_the_rendezvous_forgets_its_oldest_requests_not_all_of_them():
    rdv, _t = _rendezvous(PunchInviteReply(True, ""))
    assert asyncio.run(rdv.handle("dialer", PunchRequest("target"))).ok
    base = time.monotonic() - 10_000
    for i in range(4096):  # older requests by other peers fill the table past its bound
        rdv._last[(f"old{i}", "target")] = base + i
    assert asyncio.run(rdv.handle("flooder", PunchRequest("x"))).reason == "no direct connection to the requester"
    assert len(rdv._last) <= 4096 - 2048 + 2
    assert asyncio.run(rdv.handle("dialer", PunchRequest("target"))) == PunchReply(False, "rate limited", "")


def test_a_scheduler_attempt_turns_any_error_into_a_backed_off_failure_and_stops_after_a_missed_dial(monkeypatch):
    tried: list[str] = []

    async def broken(p2p, transport, rdv, target, scopes=None):
        tried.append(rdv)
        if rdv == "rdv1":
            raise RuntimeError("the daemon's control socket broke")
        raise holepunch.DialFailed("dialling x timed out (a symmetric NAT?)")

    monkeypatch.setattr(holepunch, "punch_through", broken)
    sched = PunchScheduler("a", ["rdv1", "rdv2", "rdv3"], None, None, dict)
    assert asyncio.run(sched.attempt("b")) is False
    # rdv1 failed before introducing us: rdv2 was asked; its punch came and our dial missed it,
    # so rdv3 was not asked (our router holds the failed SYN's mapping): retry after RETRY_S
    assert tried == ["rdv1", "rdv2"]
    assert "RuntimeError" in sched.attempts[0]["reason"] and "timed out" in sched.attempts[0]["reason"]
    assert sched._next["b"] - time.monotonic() > PunchScheduler.RETRY_S - 5


def test_punch_requests_arriving_together_wait_for_one_refresh_of_the_records():
    """Several dialers asking at once about peers the rendezvous does not know yet: one refresh of
    the records, after which all of them are judged (not refused because a refresh was running)."""
    from types import SimpleNamespace

    from groundswell.peer.node_nat import MEMBERS_REFRESH_S
    from groundswell.peer.swarm import SwarmNode

    refreshes = []

    async def go():
        node = SimpleNamespace(ctx=object(), _cached_records={}, _members_lock=asyncio.Lock(),
                               _members_refreshed=-MEMBERS_REFRESH_S)

        async def refresh_records():
            refreshes.append(1)
            await asyncio.sleep(0.05)
            node._cached_records = {p: _rec("private") for p in ("a", "b", "c")} | {"pub": _rec("public")}

        node.refresh_records = refresh_records
        check = SwarmNode._nated_members
        return await asyncio.gather(check(node, ("a", "b")), check(node, ("b", "c")), check(node, ("a", "pub")),
                                    check(node, ("a", "nobody")))

    assert asyncio.run(go()) == [True, True, False, False]
    assert refreshes == [1]


def test_a_target_takes_a_bounded_number_of_invites_and_strangers_only_half_of_them():
    """Records say who is NAT'ed and anyone may publish one in an open run: eight identities
    asking for punches to one target used to keep all its punch slots busy."""
    t = FakeTransport(PunchInviteReply(True, ""))
    sybils = [f"sybil{i}" for i in range(holepunch.MAX_PENDING)]
    workers = [f"worker{i}" for i in range(holepunch.MAX_PENDING)]
    peers = [Info(p, [D_AT]) for p in [*sybils, *workers, "fresh"]] + [Info("target", [T_AT])]
    rdv = Rendezvous(FakeP2P(peers), t, proven=lambda peer: peer.startswith("worker"))

    async def ask(who: str) -> PunchReply:
        return await rdv.handle(who, PunchRequest("target"))

    answers = [asyncio.run(ask(s)) for s in sybils]
    assert sum(a.ok for a in answers) == holepunch.MAX_PENDING // 2
    assert answers[-1].reason == "the target has enough punches under way"
    answers = [asyncio.run(ask(w)) for w in workers]  # peers that did the run's work get the rest
    assert sum(a.ok for a in answers) == holepunch.MAX_PENDING - holepunch.MAX_PENDING // 2
    assert len(t.calls) == holepunch.MAX_PENDING
    rdv._invited["target"] = [time.monotonic() - holepunch.PUNCH_WAIT_S - 1] * 8  # the window passed
    assert asyncio.run(ask("fresh")).ok


# --- what a rendezvous can make us dial (found by a review of NAT traversal) ---------------------


@pytest.mark.parametrize("address,scopes,own,ok", [
    ("/ip4/1.2.3.4/tcp/4001", frozenset({"public"}), (), True),  # (a function of the address: nothing is sent)
    ("/ip4/192.168.1.20/tcp/6379", frozenset({"public"}), (), False),  # our LAN, in an internet run
    ("/ip4/100.64.0.9/tcp/22", frozenset({"public"}), (), False),  # the carrier's NAT (CGNAT)
    ("/ip4/192.168.1.20/tcp/4001", frozenset({"public", "private"}), (), True),  # a LAN run
    ("/ip4/192.168.1.5/tcp/6379", frozenset({"public", "private"}), ("192.168.1.5",), False),  # our own interface
    ("/ip4/127.0.0.1/tcp/6379", frozenset({"public", "loopback"}), (), False),  # never this machine by loopback
    ("/ip4/192.168.1.20/tcp/4001", None, (), True),  # no scopes given: any unicast address (as before)
])
def test_an_invite_makes_a_peer_punch_only_within_the_runs_scopes_and_never_to_itself(address, scopes, own, ok):
    from groundswell.peer.holepunch import PunchTarget, may_dial
    from groundswell.peer.reachability import tcp_targets

    assert may_dial(address, tcp_targets([address])[0][0], scopes, own) is ok
    if ok:
        return  # (a punch that goes out is not sent from a test: it would leave this machine)

    async def go():
        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(1, "127.0.0.1", frozenset({"boot"}), tasks, scopes, frozenset(own))
            return await target.handle("boot", PunchInvite("dialer", address))

    assert asyncio.run(go()) == PunchInviteReply(False, "not a TCP address one may punch to")


def test_one_inviter_gets_a_bounded_number_of_punches_per_window():
    # a punch to a closed port freed its slot at once: one inviter had us send 500 SYNs in 0.03 s
    # (refused addresses here, so that nothing leaves this machine: each invite still counts)
    from groundswell.peer.holepunch import MAX_INVITES_PER_WINDOW, PunchTarget

    async def go():
        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(1, "127.0.0.1", frozenset({"boot", "boot2"}), tasks)
            return ([await target.handle("boot", PunchInvite(f"d{i}", "/ip4/127.0.0.1/tcp/1"))
                     for i in range(MAX_INVITES_PER_WINDOW + 3)],
                    await target.handle("boot2", PunchInvite("other", "/ip4/127.0.0.1/tcp/1")))

    replies, other = asyncio.run(go())
    assert [r.reason for r in replies[MAX_INVITES_PER_WINDOW:]] == ["busy: too many invites"] * 3
    assert all(r.reason != "busy: too many invites" for r in replies[:MAX_INVITES_PER_WINDOW])
    assert other.reason != "busy: too many invites"  # per inviter


@pytest.mark.parametrize("address", ["/ip4/127.0.0.1/tcp/6379", "/ip4/192.168.1.20/tcp/6379"])
def test_a_dialer_does_not_dial_an_address_outside_the_runs_scopes_whatever_the_rendezvous_says(address):
    p2p = FakeP2P([])
    p2p._client = FakeClient()
    transport = FakeTransport(PunchReply(True, "", address))
    with pytest.raises(holepunch.PunchFailed, match="an address we do not dial"):
        asyncio.run(holepunch.punch_through(p2p, transport, "rdv", "target", scopes=frozenset({"public"})))
    assert p2p._client.dialled == []


def test_requests_the_rendezvous_refuses_do_not_push_out_the_pairs_it_limits():
    async def members(ids):
        return "stranger" not in ids

    t = FakeTransport(PunchInviteReply(True, ""))
    rdv = Rendezvous(FakeP2P([Info("dialer", [D_AT]), Info("target", [T_AT])]), t, members)
    assert asyncio.run(rdv.handle("dialer", PunchRequest("target"))).ok
    for i in range(5000):  # refused: not members
        asyncio.run(rdv.handle("stranger", PunchRequest(f"t{i}")))
    assert list(rdv._last) == [("dialer", "target")]
    assert asyncio.run(rdv.handle("dialer", PunchRequest("target"))) == PunchReply(False, "rate limited", "")


def test_a_punch_target_knows_every_address_of_its_own():
    # tcp_targets keeps at most 4 (and no loopback): a host with many interfaces (Docker bridges)
    # could have been made to punch to one of its own (review)
    from groundswell.peer.holepunch import serve_punch_invites

    class Serving:
        async def serve(self, kind, msg_type, handler):
            pass

    maddrs = [f"/ip4/172.17.0.{i}/tcp/4001" for i in range(1, 7)] + ["/ip6/fd00::5/tcp/4001", "/ip4/127.0.0.1/tcp/4001"]

    async def go():
        async with asyncio.TaskGroup() as tasks:
            return await serve_punch_invites(Serving(), maddrs, ["/ip4/0.0.0.0/tcp/4001"], ["boot"], tasks)

    target = asyncio.run(go())
    assert target is not None and target.own_hosts == {m.split("/")[2] for m in maddrs}
