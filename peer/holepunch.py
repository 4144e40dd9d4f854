"""Hole punching between two peers behind NATs, set up through a rendezvous peer.

The p2pd that hivemind 1.1.12 ships has no DCUtR, so libp2p cannot punch holes itself. This
module does the one thing DCUtR would, and leaves the connection to libp2p:

    dialer D (behind NAT)  -> rendezvous R (a bootstrap peer both are connected to): punch(T)
    R -> target T, over T's own connection to R:  punch-invite(D, the address R sees D at)
    T: a socket bound to its daemon's listen port (SO_REUSEPORT, as go-libp2p binds) sends a
       SYN to D's address. D's router drops it, but T's router now lets D's address in.
    R -> D: the address R sees T at.   D's daemon dials it from its own listen port.

A cone NAT keeps a peer's listen port as its public port for every destination, so D's SYN
matches the mapping T's SYN opened. Linux conntrack, as in most home routers, also checks TCP
sequence numbers: the answer to D's SYN must come from the very socket whose SYN opened the
mapping. So T's socket, still connecting, completes a TCP simultaneous open with D's daemon, and
T forwards that connection's bytes to its own daemon on loopback. libp2p's handshake runs end to
end through it and authenticates both peers as on any connection; D's daemon sees a direct one.

A symmetric NAT gives each destination another port: D's SYN meets no mapping, the attempt
times out, and the pair stays on the relay. Only trusted rendezvous peers (the bootstrap peers)
can make a peer send a punch, and an honest one names only the address it saw the dialer at; a
peer never punches to its own machine or to a non-unicast address, whoever asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from groundswell.peer.dht_rejoin import address_scope
from groundswell.peer.reachability import connection_paths, listen_host, tcp_targets
from groundswell.protocol.framing import close_stream
from groundswell.protocol.schema import PunchInvite, PunchInviteReply, PunchReply, PunchRequest
from groundswell.protocol.transport import PeerUnavailable

log = logging.getLogger(__name__)

PUNCH_WAIT_S = 10.0  # how long an invited peer's socket waits for the dialer's SYN
INVITE_TIMEOUT_S = 5.0  # rendezvous -> target
DIAL_TIMEOUT_S = 8.0  # the dialer's daemon dialling the punched address
MAX_PENDING = 8  # punches an invited peer keeps waiting for their dialer at once (one per dialer)
MAX_FORWARDED = 64  # punched connections it forwards at once
MAX_INVITES_PER_WINDOW = 16  # invites an invited peer takes from one rendezvous per PUNCH_WAIT_S
KEEPALIVE_S = 30  # a forwarded connection whose dialer vanished is closed within ~KEEPALIVE_S + 30 s
REQUEST_EVERY_S = 5.0  # a rendezvous serves one punch per (requester, target) per this many seconds
PUMP_CHUNK = 1 << 16
HALF_CLOSED_S = 5.0  # a forward one side of which has ended is closed after this


MAX_REASON = 200  # PunchReply.reason holds 256


def punchable(host: str) -> bool:
    """Whether an invite may make us send a SYN to `host`: not to this machine, nor to anything
    that is not a unicast address on some network (IPv4-mapped IPv6 forms included)."""
    ip = ipaddress.ip_address(host)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_loopback or ip.is_unspecified or ip.is_multicast or ip.is_link_local or ip.is_reserved)


def may_dial(maddr: str, host: str, scopes: frozenset[str] | None, own_hosts: Iterable[str] = ()) -> bool:
    """Whether a punch (or the dial after one) may go to `host` (of `maddr`): `punchable`, in one of
    the run's dialable `scopes` (None: any), and not one of our own addresses. A rendezvous names
    the address; trusted or not, it must not turn us into a scanner of our LAN or machine."""
    if not punchable(host) or host in set(own_hosts):
        return False
    return scopes is None or address_scope(maddr) in scopes


class PunchFailed(Exception):
    """No direct connection came of the attempt; the reason says at which step."""


class DialFailed(PunchFailed):
    """The target punched, and our dial did not come through: no other rendezvous would help now
    (our router holds the failed SYN's mapping a while, see `PunchScheduler`)."""


Members = Callable[[tuple[str, ...]], Awaitable[bool]]


def observed_address(peer_infos: Iterable[Any], peer_id: str) -> str | None:
    """The plain TCP multiaddr of our open connection to `peer_id` (as its packets reach us), or None."""
    for info in peer_infos:
        if str(info.peer_id) != peer_id:
            continue
        for addr in getattr(info, "addrs", []):
            if tcp_targets([str(addr)]):
                return str(addr)
    return None


class Rendezvous:
    """A public peer's side: introduce two peers connected to it to each other."""

    def __init__(self, p2p: Any, transport: Any, members: Members | None = None,
                 proven: Callable[[str], bool] | None = None) -> None:
        self.p2p = p2p
        self.transport = transport
        # Only peers of the run may use us (else any libp2p identity could keep a NAT'ed peer's
        # punch slots busy, or learn its public address): `members(ids)` says whether all of
        # `ids` are NAT'ed peers of the run. None: anyone (tests).
        self.members = members
        # Records say who is NAT'ed, and in an open run anyone may publish them: a target takes
        # at most MAX_PENDING invites per PUNCH_WAIT_S from us, and requesters not `proven`
        # (named in a commit: they did the run's work) only half of them, so a few identities
        # cannot keep its punch slots busy.
        self.proven = proven or (lambda peer: False)
        self._last: dict[tuple[str, str], float] = {}
        self._invited: dict[str, list[float]] = {}  # target -> when we invited it, within PUNCH_WAIT_S
        self.served = 0

    def _room_for(self, sender: str, target: str, now: float) -> bool:
        """Take one of `target`'s invites in this window for `sender`, if there is one."""
        recent = [t for t in self._invited.get(target, []) if now - t < PUNCH_WAIT_S]
        if len(recent) >= (MAX_PENDING if self.proven(sender) else MAX_PENDING // 2):
            self._invited[target] = recent
            return False
        self._invited[target] = [*recent, now]
        if len(self._invited) > 4096:  # forget targets not invited within the window
            self._invited = {k: v for k, v in self._invited.items() if now - v[-1] < PUNCH_WAIT_S}
        return True

    async def handle(self, sender: str, msg: PunchRequest) -> PunchReply:
        """Invite `msg.target` to punch towards where we see `sender`; tell `sender` where we see the target."""
        now, key = time.monotonic(), (sender, msg.target)
        if now - self._last.get(key, -REQUEST_EVERY_S) < REQUEST_EVERY_S:
            return PunchReply(False, "rate limited", "")
        if msg.target == sender:
            return PunchReply(False, "target is the requester", "")
        if self.members is not None and not await self.members((sender, msg.target)):
            return PunchReply(False, "requester and target must both be NAT'ed peers of this run", "")
        # Noted only for members: refused requests from anyone else would push real pairs' times out.
        self._last[key] = now
        if len(self._last) > 4096:  # forget the oldest half (clearing all would lift every limit at once)
            for old in sorted(self._last, key=self._last.__getitem__)[:2048]:
                del self._last[old]
        async with asyncio.timeout(INVITE_TIMEOUT_S):  # a hung daemon must not hold the request
            peers = await self.p2p.list_peers()
        dialer_at, target_at = observed_address(peers, sender), observed_address(peers, msg.target)
        if dialer_at is None or target_at is None:
            who = "requester" if dialer_at is None else "target"
            return PunchReply(False, f"no direct connection to the {who}", "")
        if not self._room_for(sender, msg.target, now):
            return PunchReply(False, "the target has enough punches under way", "")
        try:
            reply = await self.transport.request(msg.target, "punch-invite", PunchInvite(sender, dialer_at),
                                                 PunchInviteReply, timeout_s=INVITE_TIMEOUT_S)
        except PeerUnavailable as exc:
            return PunchReply(False, f"target unreachable: {exc}"[:MAX_REASON], "")
        if not reply.ok:
            return PunchReply(False, f"target declined: {reply.reason}"[:MAX_REASON], "")
        self.served += 1
        return PunchReply(True, "", target_at)


@dataclass
class PunchTarget:
    """An invited peer's side: punch, then forward the connection that comes through to our daemon."""

    listen_port: int  # our daemon's TCP port: the punch leaves from it
    local_host: str  # where our daemon accepts the forwarded connection (loopback)
    trusted: frozenset[str]  # peer ids allowed to invite us (our bootstrap peers)
    tasks: asyncio.TaskGroup  # owns every punch and forward
    # Where an invite may make us send a SYN: the run's dialable scopes (`dialable_scopes`: public,
    # private only in a LAN run; None: any unicast address) and never one of our own addresses.
    scopes: frozenset[str] | None = None
    own_hosts: frozenset[str] = frozenset()
    pending: set[str] = field(default_factory=set)  # dialers whose punch waits for them to come through
    live: set[str] = field(default_factory=set)  # dialers whose punched connection we forward now
    _forwards: dict[str, tuple[asyncio.Task, socket.socket]] = field(default_factory=dict)  # dialer -> its forward
    forwarded: int = 0  # connections that came through a punch and were forwarded
    forwarded_bytes: int = 0
    _invites: dict[str, list[float]] = field(default_factory=dict)  # inviter -> its invites within PUNCH_WAIT_S

    async def handle(self, sender: str, msg: PunchInvite) -> PunchInviteReply:
        """Send the punch now (before answering), wait for the dialer in the background."""
        if sender not in self.trusted:
            return PunchInviteReply(False, "only a bootstrap peer may ask for a punch")
        if not self._invite_allowed(sender):
            return PunchInviteReply(False, "busy: too many invites")
        if msg.dialer in self.pending:
            return PunchInviteReply(False, "a punch for this dialer is under way")
        replacing = msg.dialer in self.live
        # (punches under way count against the forwards too: each may become one)
        if len(self.pending) >= MAX_PENDING or (len(self.live | self.pending) >= MAX_FORWARDED and not replacing):
            return PunchInviteReply(False, "busy")
        targets = tcp_targets([msg.address])
        if not targets or not may_dial(msg.address, targets[0][0], self.scopes, self.own_hosts):
            return PunchInviteReply(False, "not a TCP address one may punch to")
        host, port = targets[0]
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:  # out of file descriptors, say
            return PunchInviteReply(False, f"cannot punch: {exc.strerror or exc}")
        self.pending.add(msg.dialer)  # ours from here: another invite for this dialer is refused meanwhile
        started = False
        try:
            if replacing:
                # One punched connection per dialer. A dialer asks again only when it has lost the
                # old one (its daemon restarted, its NAT dropped the mapping) while our end still
                # looks alive, so the old forward gives way (refusing cost the dialer a long
                # backoff). Only now, with the invite checked and the socket made; a bind or
                # connect that still fails below costs the old connection (the new punch needs
                # its address pair free).
                await self._drop_forward(msg.dialer)
                if msg.dialer in self.live:
                    return PunchInviteReply(False, "busy: the old punched connection is still closing")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", self.listen_port))
                sock.setblocking(False)
                err = sock.connect_ex((host, port))  # the SYN leaves now
            except OSError as exc:
                return PunchInviteReply(False, f"cannot punch: {exc.strerror or exc}")
            if err not in (0, errno.EINPROGRESS):
                return PunchInviteReply(False, f"cannot punch: {errno.errorcode.get(err, err)}")
            try:
                self.tasks.create_task(self._complete(sock, msg.dialer))
            except RuntimeError:  # the node is shutting down
                return PunchInviteReply(False, "shutting down")
            started = True  # the task owns the socket and the pending slot now
            return PunchInviteReply(True, "")
        finally:
            if not started:
                self.pending.discard(msg.dialer)
                sock.close()

    def _invite_allowed(self, sender: str) -> bool:
        """At most MAX_INVITES_PER_WINDOW invites per inviter per PUNCH_WAIT_S: a punch to a closed
        port frees its slot at once, so the pending cap alone let one inviter have us send
        hundreds of SYNs a second."""
        now = time.monotonic()
        recent = [t for t in self._invites.get(sender, []) if now - t < PUNCH_WAIT_S]
        if len(recent) >= MAX_INVITES_PER_WINDOW:
            self._invites[sender] = recent
            return False
        self._invites[sender] = [*recent, now]
        return True

    async def _complete(self, sock: socket.socket, dialer: str) -> None:
        try:
            try:
                came = await _connected(sock, PUNCH_WAIT_S)
            finally:
                self.pending.discard(dialer)
            if not came:
                log.info("hole punch for %s: the dialer did not come through", dialer[-8:])
                return
            log.info("hole punch for %s: connected, forwarding to our daemon", dialer[-8:])
            _keepalive(sock)
            me = asyncio.current_task()
            assert me is not None
            self.live.add(dialer)
            self._forwards[dialer] = (me, sock)
            await self._forward(sock)
        except OSError as exc:
            log.info("hole punch for %s: %s", dialer[-8:], exc)
        except Exception as exc:  # a task of the node's own group: a bug here must not stop the node
            log.error("hole punch for %s failed: %r", dialer[-8:], exc, exc_info=exc)
        finally:
            if self._forwards.get(dialer, (None,))[0] is asyncio.current_task():
                del self._forwards[dialer]
                self.live.discard(dialer)
            sock.close()

    async def _drop_forward(self, dialer: str) -> None:
        """End `dialer`'s forward now, by a reset: no TIME_WAIT is left on its address pair, which
        the new punch (from the same port, to the same address, usually) needs free."""
        forward = self._forwards.get(dialer)
        if forward is None:
            return
        task, sock = forward
        log.info("hole punch for %s: asked again, dropping its old forward", dialer[-8:])
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:  # already closed
            pass
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)

    async def _forward(self, sock: socket.socket) -> None:
        outer_r, outer_w = await asyncio.open_connection(sock=sock)
        try:
            async with asyncio.timeout(INVITE_TIMEOUT_S):  # our own daemon: it answers at once, or is stuck
                inner_r, inner_w = await asyncio.open_connection(self.local_host, self.listen_port)
            try:
                self.forwarded += 1
                async with asyncio.TaskGroup() as pumps:
                    both = [pumps.create_task(self._pump(outer_r, inner_w)),
                            pumps.create_task(self._pump(inner_r, outer_w))]
                    await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
                    # One side is done: the other gets a grace for its last bytes, then both are
                    # closed (a dialer that never closes its end must not hold the forward).
                    _, running = await asyncio.wait(both, timeout=HALF_CLOSED_S)
                    if running:
                        close_stream(inner_w)
                        close_stream(outer_w)
                if not running:  # both sides done: their last bytes go out before we close (bounded)
                    await _flush_and_close(inner_w)
                    await _flush_and_close(outer_w)
            finally:
                close_stream(inner_w)
        finally:
            close_stream(outer_w)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(PUMP_CHUNK):
                dst.write(data)
                self.forwarded_bytes += len(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except OSError:  # one side reset: close both (the other pump then ends too)
            dst.close()


def _keepalive(sock: socket.socket) -> None:
    """Notice a dialer that vanished without closing (its pump would otherwise wait ~15 min)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_S), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", (KEEPALIVE_S + 30) * 1000)):
        if hasattr(socket, name):  # Linux has them all
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


async def _connected(sock: socket.socket, timeout_s: float) -> bool:
    """Whether a non-blocking connect in progress on `sock` completes within `timeout_s`."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_writer(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        async with asyncio.timeout(timeout_s):
            await ready
    except TimeoutError:
        return False
    finally:
        loop.remove_writer(sock.fileno())
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0


async def punch_through(p2p: Any, transport: Any, rendezvous: str, target: str,
                        scopes: frozenset[str] | None = None) -> str:
    """Ask `rendezvous` to have `target` punch towards us, then dial it; the address dialled (only
    one `may_dial` allows, in `scopes`). Raises PunchFailed (the libp2p connection is not there)
    with the step that failed."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    try:
        reply = await transport.request(rendezvous, "punch", PunchRequest(target), PunchReply,
                                        timeout_s=INVITE_TIMEOUT_S + 5)
    except PeerUnavailable as exc:
        raise PunchFailed(f"rendezvous: {exc}") from exc
    if not reply.ok:
        raise PunchFailed(reply.reason)
    targets = tcp_targets([reply.address])
    if not targets:
        raise PunchFailed(f"rendezvous gave no TCP address: {reply.address!r}")
    if not may_dial(reply.address, targets[0][0], scopes):
        raise PunchFailed(f"rendezvous gave an address we do not dial: {reply.address!r}")
    try:
        async with asyncio.timeout(DIAL_TIMEOUT_S):
            await p2p._client.connect(PeerID.from_base58(target), [Multiaddr(reply.address)])
    except TimeoutError as exc:
        raise DialFailed(f"dialling {reply.address} timed out (a symmetric NAT?)") from exc
    except Exception as exc:  # the daemon's ControlFailure: its words, one line
        raise DialFailed(f"dialling {reply.address}: {(str(exc).splitlines() or [''])[0][:200]}") from exc
    # The daemon's connect also "succeeds" when the peer is already connected, relayed included.
    try:
        async with asyncio.timeout(DIAL_TIMEOUT_S):  # a hung daemon must not hold the scheduler's slot
            paths = connection_paths(await p2p.list_peers())
    except TimeoutError as exc:
        raise DialFailed("our daemon did not list its connections") from exc
    if paths.get(target) != "direct":
        raise DialFailed("no direct connection came of it (connected through a relay only)")
    return reply.address


async def serve_punch_invites(transport: Any, maddrs: list[str], host_maddrs: Iterable[str],
                              trusted: list[str], tasks: asyncio.TaskGroup,
                              scopes: frozenset[str] | None = None) -> PunchTarget | None:
    """Behind a NAT: let our bootstrap peers (`trusted`) ask us to punch towards a peer about to
    dial us, at an address in `scopes` (the run's dialable scopes); None if the daemon has no
    plain TCP listen address to punch from."""
    port, host = listen_port(maddrs), listen_host(list(host_maddrs))
    if port is None or host is None:
        return None
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # our daemon, as seen from here
    own = frozenset(part.split("/")[2] for part in maddrs if part.count("/") >= 2)  # every address of ours
    target = PunchTarget(port, local, frozenset(trusted), tasks, scopes, own)
    await transport.serve("punch-invite", PunchInvite, target.handle)
    return target


def listen_port(maddrs: Iterable[str]) -> int | None:
    """The TCP port of our daemon's plain TCP listen addresses (they share one), or None."""
    targets = tcp_targets(list(maddrs))
    return targets[0][1] if targets else None


async def _flush_and_close(writer: asyncio.StreamWriter) -> None:
    """Close a finished forward's side once its buffered bytes are out (at most HALF_CLOSED_S)."""
    writer.close()
    with contextlib.suppress(TimeoutError, OSError):
        await asyncio.wait_for(writer.wait_closed(), HALF_CLOSED_S)
