"""Hole punching's parts without NATs: the rendezvous, the invited peer's checks and forwarding,
and which pairs a volunteer tries when. The punch through real NATs is in tests/test_netlab.py."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

import pytest
from groundswell.peer import holepunch
from groundswell.peer.holepunch import PunchScheduler, PunchTarget, Rendezvous, observed_address
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD = "not a TCP address one may punch to"


@pytest.mark.parametrize("sender,address,reason", [
    ("stranger", "/ip4/10.1.2.3/tcp/4001", "only a bootstrap peer may ask for a punch"),
    ("boot", "/ip4/127.0.0.1/tcp/4001", BAD),
    ("boot", "/ip6/::ffff:127.0.0.1/tcp/4001", BAD),
    ("boot", "/ip4/169.254.1.1/tcp/4001", BAD),
    ("boot", "/ip4/0.0.0.0/tcp/4001", BAD),
    ("boot", "/ip4/224.0.0.1/tcp/4001", BAD),
    ("boot", "/dns/example.org/tcp/4001", BAD),
    ("boot", "/ip4/10.1.2.3/udp/4001", BAD),
])
def test_an_invited_peer_punches_only_for_its_bootstrap_peers_and_only_to_tcp_addresses(sender, address, reason):
    async def go():
        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(_free_port(), "127.0.0.1", frozenset({"boot"}), tasks)
            return await target.handle(sender, PunchInvite("dialer", address)), target

    reply, target = asyncio.run(go())
    assert not reply.ok and reply.reason == reason and target.pending == set()


@pytest.mark.parametrize("pending,live,dialer,reason", [
    ({f"d{i}" for i in range(holepunch.MAX_PENDING)}, set(), "dialer", "busy"),
    (set(), {f"d{i}" for i in range(holepunch.MAX_FORWARDED)}, "dialer", "busy"),
    ({"dialer"}, set(), "dialer", "a punch for this dialer is under way"),
])
def test_an_invited_peer_bounds_its_punches(pending, live, dialer, reason):
    async def go():
        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(_free_port(), "127.0.0.1", frozenset({"boot"}), tasks, pending=set(pending),
                                 live=set(live))
            return await target.handle("boot", PunchInvite(dialer, "/ip4/10.1.2.3/tcp/4001"))

    assert asyncio.run(go()) == PunchInviteReply(False, reason)


def test_a_refused_connect_is_not_taken_for_a_punch_that_came_through():
    async def go():
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", _free_port()))  # nobody listens: refused
        try:
            return await holepunch._connected(sock, 5.0)
        finally:
            sock.close()

    assert asyncio.run(go()) is False


def test_a_punched_connection_is_forwarded_both_ways_to_our_daemon():
    """The socket a punch left connected carries the dialer's bytes to our daemon's port and back."""

    async def go():
        daemon_got: list[bytes] = []

        async def daemon(r, w):  # our libp2p daemon, as far as the forwarder can tell
            daemon_got.append(await r.readexactly(5))
            w.write(b"world")
            await w.drain()
            await r.read()  # until the dialer's side closes
            w.close()

        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        daemon_srv = await asyncio.start_server(daemon, "127.0.0.1", 0)
        dialer_srv = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)), "127.0.0.1", 0)
        daemon_port = daemon_srv.sockets[0].getsockname()[1]
        dialer_port = dialer_srv.sockets[0].getsockname()[1]
        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(daemon_port, "127.0.0.1", frozenset({"boot"}), tasks)
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", dialer_port))  # stands in for the punch that came through
            tasks.create_task(target._complete(sock, "dialer"))
            r, w = await asyncio.wait_for(accepted, 5)
            w.write(b"hello")
            await w.drain()
            reply = await asyncio.wait_for(r.readexactly(5), 5)
            w.close()
        daemon_srv.close()
        dialer_srv.close()
        return daemon_got, reply, target

    daemon_got, reply, target = asyncio.run(go())
    assert daemon_got == [b"hello"] and reply == b"world"
    assert target.forwarded == 1 and target.forwarded_bytes == 10 and target.live == set()


def test_an_invite_sends_the_punch_from_the_daemons_port_and_forwards_what_comes_through(monkeypatch):
    """Without NATs (loopback) the punch's SYN is simply accepted: the connection must leave from
    our daemon's listen port, be answered at once, and carry bytes to our daemon and back."""
    monkeypatch.setattr(holepunch, "punchable", lambda host: True)  # loopback is refused otherwise

    async def go():
        async def daemon(r, w):
            w.write((await r.readexactly(4)).upper())
            await w.drain()
            await r.read()
            w.close()

        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        daemon_srv = await asyncio.start_server(daemon, "127.0.0.1", 0, reuse_port=True)  # as go-libp2p binds
        dialer_srv = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)), "127.0.0.1", 0)
        daemon_port = daemon_srv.sockets[0].getsockname()[1]
        dialer_port = dialer_srv.sockets[0].getsockname()[1]
        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(daemon_port, "127.0.0.1", frozenset({"boot"}), tasks)
            reply = await target.handle("boot", PunchInvite("dialer", f"/ip4/127.0.0.1/tcp/{dialer_port}"))
            r, w = await asyncio.wait_for(accepted, 5)
            source_port = w.get_extra_info("peername")[1]
            w.write(b"ping")
            await w.drain()
            echoed = await asyncio.wait_for(r.readexactly(4), 5)
            live = set(target.live)
            w.close()
        daemon_srv.close()
        dialer_srv.close()
        return reply, source_port, daemon_port, echoed, live, target

    reply, source_port, daemon_port, echoed, live, target = asyncio.run(go())
    assert reply == PunchInviteReply(True, "")
    assert source_port == daemon_port  # the NAT mapping is the daemon's: its dial-backs will match
    assert echoed == b"PING" and live == {"dialer"}
    assert target.pending == set() and target.live == set()


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

    async def failing():
        calls.append(1)
        raise OSError("the daemon's control socket is gone")

    sched.once = failing  # type: ignore[method-assign]

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

    async def fake_punch(p2p, transport, rdv, target):
        tried.append((rdv, target))
        if target in outcome:
            raise outcome[target]
        return "/ip4/10.99.0.22/tcp/4002"

    monkeypatch.setattr(holepunch, "punch_through", fake_punch)
    records = {"a-smaller": _rec("private"), "m-later": _rec("private"), "n-direct": _rec("private"),
               "o-public": _rec("public"), "p-ok": _rec("private")}
    p2p = FakeP2P([Info("n-direct", ["/ip4/10.99.0.23/tcp/1"])])
    sched = PunchScheduler("m", ["rdv1", "rdv2"], p2p, None, lambda: records)
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
    rdv, t = _rendezvous(PunchInviteReply(True, ""))
    assert asyncio.run(rdv.handle("dialer", PunchRequest("target"))).ok
    base = time.monotonic() - 10_000
    for i in range(4096):  # older requests by other peers fill the table past its bound
        rdv._last[(f"old{i}", "target")] = base + i
    assert asyncio.run(rdv.handle("flooder", PunchRequest("x"))).reason == "no direct connection to the requester"
    assert len(rdv._last) <= 4096 - 2048 + 2
    assert asyncio.run(rdv.handle("dialer", PunchRequest("target"))) == PunchReply(False, "rate limited", "")


def test_a_dialer_that_asks_again_gets_a_new_punch_in_place_of_its_old_forward(monkeypatch):
    """A dialer asks again only when it lost the old connection while our end still looks alive:
    the old forward is reset (no TIME_WAIT on the address pair) and the new punch, from the same
    port to the same address, goes through; there is still one forward per dialer."""
    monkeypatch.setattr(holepunch, "punchable", lambda host: True)  # loopback is refused otherwise

    async def go():
        async def daemon(r, w):
            await r.read()
            w.close()

        came: asyncio.Queue = asyncio.Queue()
        daemon_srv = await asyncio.start_server(daemon, "127.0.0.1", 0, reuse_port=True)
        dialer_srv = await asyncio.start_server(lambda r, w: came.put_nowait((r, w)), "127.0.0.1", 0)
        daemon_port = daemon_srv.sockets[0].getsockname()[1]
        address = f"/ip4/127.0.0.1/tcp/{dialer_srv.sockets[0].getsockname()[1]}"
        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(daemon_port, "127.0.0.1", frozenset({"boot"}), tasks)
            first = await target.handle("boot", PunchInvite("dialer", address))
            old_r, old_w = await asyncio.wait_for(came.get(), 5)
            for _ in range(100):
                if "dialer" in target.live:
                    break
                await asyncio.sleep(0.01)
            second = await target.handle("boot", PunchInvite("dialer", address))
            new_r, new_w = await asyncio.wait_for(came.get(), 5)
            try:
                old_end = await asyncio.wait_for(old_r.read(), 5)
            except ConnectionResetError:
                old_end = b"reset"
            live, forwards = set(target.live), len(target._forwards)
            same_port = new_w.get_extra_info("peername")[1] == old_w.get_extra_info("peername")[1] == daemon_port
            new_w.close()
            old_w.close()
        daemon_srv.close()
        dialer_srv.close()
        return first, second, old_end, live, forwards, same_port

    first, second, old_end, live, forwards, same_port = asyncio.run(go())
    assert first == second == PunchInviteReply(True, "")
    assert old_end in (b"", b"reset") and same_port  # the old one ended; the new one reuses the pair
    assert live == {"dialer"} and forwards == 1


def test_a_forward_ends_when_our_daemon_hangs_up_even_if_the_dialer_never_does(monkeypatch):
    """A dialer that completes the punch and then never closes must not keep the forward (two
    sockets and a `live` slot) once our daemon has closed its side."""
    monkeypatch.setattr(holepunch, "HALF_CLOSED_S", 0.3)

    async def go():
        async def daemon(r, w):  # takes the connection and hangs up at once (a failed handshake)
            w.close()

        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        daemon_srv = await asyncio.start_server(daemon, "127.0.0.1", 0)
        dialer_srv = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)), "127.0.0.1", 0)
        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(daemon_srv.sockets[0].getsockname()[1], "127.0.0.1", frozenset({"boot"}), tasks)
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", dialer_srv.sockets[0].getsockname()[1]))
            forward = tasks.create_task(target._complete(sock, "dialer"))
            r, w = await asyncio.wait_for(accepted, 5)  # the dialer: holds its end open, says nothing
            t0 = time.monotonic()
            await asyncio.wait_for(forward, 5)
            took = time.monotonic() - t0
            eof = await asyncio.wait_for(r.read(), 5)  # our side closed the punched connection
            w.close()
        daemon_srv.close()
        dialer_srv.close()
        return took, eof, target

    took, eof, target = asyncio.run(go())
    assert took < 3 and eof == b"" and target.live == set() and target.forwarded == 1


def test_a_scheduler_attempt_turns_any_error_into_a_backed_off_failure_and_stops_after_a_missed_dial(monkeypatch):
    tried: list[str] = []

    async def broken(p2p, transport, rdv, target):
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

    from groundswell.peer.swarm import MEMBERS_REFRESH_S, SwarmNode

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


def test_an_invite_that_is_refused_leaves_the_dialers_old_forward_alone():
    async def go():
        async with asyncio.TaskGroup() as tasks:
            old = tasks.create_task(asyncio.sleep(30))  # stands in for the live forward
            target = PunchTarget(_free_port(), "127.0.0.1", frozenset({"boot"}), tasks, live={"dialer"})
            target._forwards["dialer"] = (old, socket.socket())
            reply = await target.handle("boot", PunchInvite("dialer", "/ip4/127.0.0.1/tcp/4001"))  # our own machine
            alive = not old.done()
            target._forwards["dialer"][1].close()
            old.cancel()
            return reply, alive, target

    reply, alive, target = asyncio.run(go())
    assert reply == PunchInviteReply(False, "not a TCP address one may punch to")
    assert alive and target.live == {"dialer"} and target.pending == set()


def test_two_invites_for_one_dialer_at_once_make_one_punch(monkeypatch):
    """The second arrives while the first waits for the dialer's old forward to go: it is refused
    instead of punching twice (two forwards for one dialer, one of them untracked)."""
    monkeypatch.setattr(holepunch, "punchable", lambda host: True)
    calls: list[str] = []

    async def go():
        gate = asyncio.Event()

        async def slow_drop(dialer):  # the old forward takes a while to go
            calls.append(dialer)
            await gate.wait()
            target.live.discard(dialer)

        async with asyncio.TaskGroup() as tasks:
            target = PunchTarget(_free_port(), "127.0.0.1", frozenset({"boot"}), tasks, live={"dialer"})
            target._drop_forward = slow_drop
            first = tasks.create_task(target.handle("boot", PunchInvite("dialer", "/ip4/127.0.0.1/tcp/9")))
            await asyncio.sleep(0.05)
            second = await target.handle("boot", PunchInvite("dialer", "/ip4/127.0.0.1/tcp/9"))
            gate.set()
            first_reply = await first
            await asyncio.sleep(0.05)
        return first_reply, second

    first, second = asyncio.run(go())
    assert second == PunchInviteReply(False, "a punch for this dialer is under way")
    assert first.ok and calls == ["dialer"]
