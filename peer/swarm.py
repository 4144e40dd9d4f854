"""The network side of a peer: libp2p host, DHT, round protocol, state and manifest serving.

`SwarmNode` runs an asyncio loop in one background thread it owns (`net_loop.NetLoop`; started by `start`, ended by
`close`); training stays in the caller's thread. Every task on that loop belongs to the node's
TaskGroup. The trainer talks to the node through `call` (run a coroutine and wait) and through
`SwarmExchange`, the `optim.Exchange` over the swarm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

from groundswell.protocol.client import RoundClient
from groundswell.protocol.context import DecisionBook
from groundswell.protocol.direct import DirectServer
from groundswell.protocol.guard import Guard
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import (
    Decision,
    ManifestReply,
    ManifestRequest,
    PeerRecord,
    ProbeRequest,
    PunchRequest,
    StateRequest,
)
from groundswell.protocol.server import RoundServer
from groundswell.protocol.transport import PeerUnavailable, Transport

from .daemon import (
    TEARDOWN_S,
    bounded,
    daemon_exited,
    raise_open_file_limit,
    reap_daemons,
    release_private_sockets,
    watch_daemon,
    with_private_sockets,
)
from .dht_entry import dial_known, enter_run_dht
from .dht_rejoin import DhtRejoiner, dialable_scopes
from .holepunch import Rendezvous, serve_punch_invites
from .net_errors import NetworkError, explain_start_failure
from .net_loop import NetLoop
from .node_nat import MEMBERS_REFRESH_S, NatTraversal
from .node_options import NodeOptions, reader_options  # noqa: F401 - imported from here too
from .punch_scheduler import PunchScheduler
from .reachability import (
    DialBack,
    listen_host,
)
from .record_storage import CommitMembers, guard_record_storage
from .records import HEARTBEAT_S, PeerRecords, PeerRecordValidator, guard_find_answers
from .run_state import GlobalState, RunContext
from .state_download import state_timeout_s
from .state_serving import StateServing, UploadSlots

log = logging.getLogger(__name__)
T = TypeVar("T")


class SwarmNode(PeerRecords, StateServing, NatTraversal, NetLoop):
    """A peer's network presence; owns the loop thread, the libp2p daemon and the DHT node."""

    def __init__(self, identity: Identity, identity_path: str, options: NodeOptions) -> None:
        self.identity = identity
        self.identity_path = identity_path
        self.ctx: RunContext | None = None  # set by `attach` once the manifest is verified
        self.options = options
        self._cached_records: dict[str, PeerRecord] = {}
        self._members_refreshed = -MEMBERS_REFRESH_S  # last refresh of the records for a punch request
        self._members_lock = asyncio.Lock()
        self._refreshing: Future | None = None  # a background refresh of the cached records
        self.rejected_records = 0
        self.bootstrap_transport: Transport | None = None
        self.signed_manifest: bytes = b""
        self.state_provider: Callable[[], GlobalState | None] = lambda: None
        self.record = PeerRecord(-1, "", options.role, options.trains, options.serves, [], "unknown", 0.0, 0, 0.0)
        NetLoop.__init__(self)
        self._stop: asyncio.Event | None = None
        self._main: Future | None = None
        self._run_task: asyncio.Task | None = None  # what `_main` runs, on the loop
        self._start_cancelled = False  # closed before `_run` began (see `_stop_soon`)
        self._ready = threading.Event()
        self.maddrs: list[str] = []
        self.book: DecisionBook | None = None
        self.server: RoundServer | None = None
        self.client: RoundClient | None = None
        self.transport: Transport | None = None
        self.dht: Any = None
        self.p2p: Any = None
        self.reachability = "unknown"
        self.direct: DirectServer | None = None  # direct state downloads, when offered
        self.direct_received = 0  # bytes of state downloaded over other peers' direct ports
        self.uploads = UploadSlots()  # state uploads over streams
        self.state_building = asyncio.Lock()  # see `_on_state`
        self.puncher: PunchScheduler | None = None  # behind a NAT: direct connections to NAT'ed peers
        self.punch_target: Any = None  # behind a NAT: our side of the punches others dial
        self.announce_punch: Callable[[str, str], None] | None = None  # told of the first punch that works
        self.startup_s: dict[str, float] = {}  # where start-up time went: daemon(s), reachability probe, DHT
        self._dial_back = DialBack()
        self.guard = Guard()  # every transport of this node: limits and bans are per remote peer
        self._error: BaseException | None = None
        self._down: str | None = None  # why the running node stopped by itself (see `_run`)
        # After a network outage; dialling only addresses where the run's own are (see dialable_scopes).
        own = options.initial_peers or options.announce_maddrs or options.host_maddrs
        self.rejoiner = DhtRejoiner(identity.peer_id, options.initial_peers, scopes=dialable_scopes(own))
        # (the DHT's: see records.lives_as_signed; a full records key keeps the records of peers
        # that did the run's work, the coordinator's and ours first: peer/record_storage.py)
        members = CommitMembers()  # (the rejoiner's proven peers are capped at 256: not these)
        self.record_validator = PeerRecordValidator(
            lambda pid: bool(pid) and pid in (identity.peer_id, options.coordinator) or pid in members.of(self.book)
            or self.rejoiner.is_proven(pid))
        # Proven peers of the run this start entered through, its bootstrap peers being down or
        # silent (`dht_entry.enter_run_dht`); empty when one of those let it in.
        self.entered_through: list[str] = []
        self.bootstrap_down = False  # p2pd reached none of the bootstrap peers: started without them
        self._bootstrap_silent = False  # connected to them, but none answered the dial-back probe
        self._start_by = float("inf")  # monotonic time `start` gives up at

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> None:
        """Start the loop thread, the libp2p host, the DHT and the protocol handlers."""
        raise_open_file_limit()  # (before the daemon starts: it inherits the limit)
        self._start_by = time.monotonic() + timeout_s
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        try:
            ready = self._ready.wait(timeout_s)
        except BaseException:  # Ctrl+C during start-up: shut down what has started
            self.close()
            raise
        if not ready or self._error is not None:
            err = self._error or TimeoutError("network start-up timed out")
            self.close()
            raise explain_start_failure(err, self.options.initial_peers, self.options.role) from err

    async def _run(self) -> None:
        from hivemind.dht.node import DHTNode
        from hivemind.p2p import P2P

        self._run_task = asyncio.current_task()
        if self._start_cancelled:
            return
        self._stop = asyncio.Event()
        p2p = dht = p2p_class = None
        try:
            explicit = self.options.reachability if self.options.reachability != "auto" else None
            await self._check_listen_addresses()
            t0 = time.monotonic()
            p2p_class = with_private_sockets(P2P)  # released in the finally below
            p2p = await self._create_p2p(p2p_class, explicit)
            if self.bootstrap_down:  # the proven peers we reach answer the probe in their place
                self.entered_through = await dial_known(p2p, self.rejoiner.proven_targets())
            t1 = time.monotonic()
            self.reachability = await self._find_reachability()
            t2 = time.monotonic()
            if self.reachability == "private" and explicit is None:
                # Restart the daemon (same identity) knowing it is private: only then does
                # libp2p's autorelay ask the relays for a slot, and its AutoNAT alone rarely
                # reaches that verdict with the few dial-back servers a run has (a netlab
                # volunteer behind NAT had no reservation after 5 minutes; forced, it has one
                # within seconds, its bootstrap peers being its static relays).
                await bounded(p2p.shutdown, "libp2p daemon, to restart it as private")
                p2p = None
                await reap_daemons()  # one that did not stop in time
                p2p = await self._create_p2p(p2p_class, "private")
            # The manifest is served outside any run (the joiner learns the run id from it); it
            # is signed by the coordinator, whose key the joiner already has.
            await self.bootstrap_transport.serve("get-manifest", ManifestRequest, self._on_manifest)
            if self.reachability != "private":
                # Not behind a NAT: a punched connection reaches our daemon from loopback, and a
                # dial-back "at the IP it came from" would then probe our own machine's ports.
                await self.bootstrap_transport.serve("probe", ProbeRequest, self._on_probe)
            if self.reachability == "public":  # introduce NAT'ed peers to each other
                rendezvous = Rendezvous(p2p, self.bootstrap_transport, self._nated_members, self._contributed)
                await self.bootstrap_transport.serve("punch", PunchRequest, rendezvous.handle)
            if self.reachability == "private":
                self.options = dataclasses.replace(self.options, serves=False)
            self.record = dataclasses.replace(self.record, serves=self.options.serves, reachability=self.reachability)
            host = listen_host(self.options.host_maddrs)
            if self.options.direct_state and host is not None and self.reachability != "private":
                direct = DirectServer()
                try:
                    await direct.start(host, self.options.direct_port)
                    self.direct = direct
                except OSError as exc:
                    if self.options.direct_port:  # asked for by number (a firewall rule names it): say so
                        raise NetworkError(f"TCP port {self.options.direct_port} on {host} for direct state "
                                           f"downloads (--state-port) cannot be used: {exc.strerror or exc}; "
                                           "choose another, 0 for any free port, or -1 for none") from None
                    # any free port failing is rare: joiners then get the state over libp2p
                    log.warning("direct state downloads are off: cannot listen on %s: %s", host, exc)
            t3 = time.monotonic()
            # (bootstrapped by `enter_dht`, which retries where hivemind's own bootstrap gives up in 3 s)
            # (no caching of what lookups find: an answer a hostile node made up was cached, then
            # served to every other lookup and peer as if it were the run's records; a review)
            dht = await DHTNode.create(p2p=p2p, initial_peers=None, client_mode=self.reachability == "private",
                                       record_validator=self.record_validator, cache_locally=False, cache_nearest=0)
            guard_find_answers(dht.protocol)
            guard_record_storage(dht.protocol, self.record_validator)
            self.dht = dht
            self.entered_through = await enter_run_dht(
                p2p, dht, self.rejoiner, self.options.initial_peers, self.options.coordinator or "",
                self.bootstrap_down, self._bootstrap_silent, self._start_by - 5.0)  # (5 s kept for the rest)
            self.startup_s = {"p2pd": t1 - t0, "probe": t2 - t1, "dht": time.monotonic() - t3}
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                if self.reachability == "private" and self.options.hole_punch:  # see peer/holepunch.py
                    self.punch_target = await serve_punch_invites(self.bootstrap_transport, self.maddrs, self.options.host_maddrs,
                                              self._bootstrap_ids(), tasks, self.rejoiner.scopes)
                tasks.create_task(watch_daemon(p2p))  # a daemon that died (out of memory, say) stops the node
                self._ready.set()
                await self._stop.wait()
                raise _Stop()
        except* _Stop:
            pass
        except* Exception as group:  # (a cancellation goes on up: the loop is being shut down)
            self._error = group.exceptions[0]
            if self._ready.is_set():
                # A task of the running node failed, and the TaskGroup took every other one down
                # with it: the node serves and hears nothing now. Say so, and fail every later
                # call (`_check_up`), rather than train on as a peer nobody can reach.
                log.error("the network stopped: %r", self._error, exc_info=self._error)
                self._down = f"the network stopped ({self._error!r:.200}); start again to rejoin the run"
            self._ready.set()  # a start-up failure: `start` reports it
        finally:
            # Each step bounded: a frozen or dead daemon never answers hivemind's shutdown calls,
            # and the steps after them (killing that daemon, above all) must still run.
            try:
                if self.direct is not None:
                    await bounded(self.direct.close, "direct state port")
                if dht is not None:
                    if self.ctx is not None and self._ready.is_set() and self._down is None:  # left cleanly
                        await bounded(self._withdraw_record, "peer record", timeout_s=HEARTBEAT_S)
                    # (its calls go through the daemon: with the daemon dead, they wait for nothing)
                    await bounded(dht.shutdown, "DHT", timeout_s=0.5 if daemon_exited(p2p) else TEARDOWN_S)
                if p2p is not None:
                    await bounded(p2p.shutdown, "libp2p daemon")
            finally:
                try:
                    await reap_daemons()  # one that failed to start, or did not stop in time
                finally:  # (even when the reap is cut short: the socket dir's count must not leak)
                    if p2p_class is not None:
                        release_private_sockets()

    async def watch_records(self, run_id: str, max_clock_skew_s: float | None = None) -> None:
        """Check the peer records of `run_id` this node reads or keeps (signed by the peer they
        name, ...: `PeerRecordValidator`); a reader that never attaches to the run needs it too,
        or any DHT node could hide a peer's record, or fail the whole lookup, with junk."""
        if max_clock_skew_s is None:
            self.record_validator.watch(run_id, self.dht)  # (the largest skew a manifest allows)
        else:
            self.record_validator.watch(run_id, self.dht, max_clock_skew_s)

    async def _attach(self, ctx: RunContext) -> None:
        self.ctx = ctx
        await self.watch_records(ctx.run_id, ctx.limits.max_clock_skew_s)
        self.guard.limits = ctx.limits
        self.transport = Transport(self.p2p, self.identity, ctx.run_id, self.guard)
        self.book = DecisionBook(ctx.run_id)
        self.server = RoundServer(ctx, self.transport, self.book, self.identity, self._tasks)
        await self.server.start()
        self.client = RoundClient(self.server, self.holders)
        self.server.prefetch = self.client.hold_aggregate
        self.server.individual = self.client.gather_contributions
        await self.transport.serve("get-state", StateRequest, self._on_state, max_request=4096, trailer=True,
                                   timeout_s=state_timeout_s(sum(ctx.segment_numels)))  # as long as a joiner waits
        self._tasks.create_task(self._heartbeat())
        if self.reachability == "private" and self.options.hole_punch:
            self.puncher = PunchScheduler(self.identity.peer_id, self._bootstrap_ids(), self.p2p,
                                          self.bootstrap_transport, lambda: self._cached_records, self.punch_target)
            self.puncher.announce = self.announce_punch
            self.puncher.proven = self.rejoiner.is_proven
            self.puncher.scopes = self.rejoiner.scopes
            self._tasks.create_task(self.puncher.run())

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received so far: frames on our libp2p streams, and state downloads over
        the direct TCP path (whole or not when served; whole when fetched). Not the DHT's own
        traffic, nor libp2p's or TCP's framing and encryption."""
        both = [t for t in (self.transport, self.bootstrap_transport) if t is not None]
        sent = sum(t.bytes_sent for t in both) + (self.direct.bytes_sent if self.direct is not None else 0)
        return sent, sum(t.bytes_received for t in both) + self.direct_received

    def state_sent(self) -> int:
        """Of `traffic()`'s bytes sent, those of states served to joiners (stream trailers and the
        direct TCP path): a churn run's figure, apart from the rounds' own exchange."""
        both = [t for t in (self.transport, self.bootstrap_transport) if t is not None]
        return sum(t.trailer_bytes_sent for t in both) + (self.direct.bytes_sent if self.direct is not None else 0)

    def _bootstrap_ids(self) -> list[str]:
        return [m.rsplit("/p2p/", 1)[-1] for m in self.options.initial_peers if "/p2p/" in m]

    def record_decision(self, signed: bytes, supersede: bool = False) -> Decision:
        """Add a committed decision to our book from another thread (the book wakes waiters on the
        network loop, which only code on that loop may do). `supersede`: in place of a conflicting
        commit (see `DecisionBook.supersede`)."""
        assert self.book is not None
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop in this thread
            on_loop = False
        if on_loop:
            return self.book.supersede(signed) if supersede else self.book.add(signed)

        async def add() -> Decision:
            assert self.book is not None
            return self.book.supersede(signed) if supersede else self.book.add(signed)

        return self.call(add(), timeout_s=30)

    def attach(self, ctx: RunContext) -> None:
        """Join the run: register the round protocol and state handlers, start heartbeats."""
        try:
            self.call(self._attach(ctx), timeout_s=30)
        except TimeoutError:  # (a TimeoutError reaches the user as a traceback: it means a bug elsewhere)
            raise NetworkError("the libp2p daemon did not take this run's handlers within 30 s (is the machine "
                               "overloaded, or the daemon stopped?): start again") from None

    async def fetch_manifest(self, peers: Sequence[str], timeout_s: float = 15.0, tries: int = 3,
                             accept: Callable[[bytes], str | None] = lambda signed: None) -> bytes:
        """The signed manifest from the first of `peers` that has one `accept` takes (it returns
        why not, or None); a lossy link can reset the first stream, so every peer is asked up to
        `tries` times. One peer serving another run's manifest (a stale address in a bootstrap
        line) or a forged one does not stop the others from being asked."""
        refused: dict[str, str] = {}  # peer -> why its manifest was not taken (it is not asked again)
        none_yet = False  # a peer answered with none (it is asked again)
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(attempt)
            for peer in [p for p in dict.fromkeys(peers) if p not in refused]:
                try:
                    reply = await self.bootstrap_transport.request(  # type: ignore[union-attr]
                        peer, "get-manifest", ManifestRequest(), ManifestReply, timeout_s=timeout_s)
                except PeerUnavailable as exc:
                    log.info("manifest from %s (try %d): %s", peer[-8:], attempt + 1, exc)
                    continue
                if not reply.signed:  # a volunteer not in the run yet (restarting too): asked again
                    log.info("%s has no manifest yet (try %d)", peer[-8:], attempt + 1)
                    none_yet = True
                    continue
                why = accept(reply.signed)
                if why is None:
                    return reply.signed
                log.info("the manifest from %s is not taken: %s", peer[-8:], why)  # the CLI says why
                refused[peer] = why
            if set(refused) >= set(peers):
                break  # every peer answered with one we cannot take: asking again changes nothing
        if refused and set(refused) >= set(peers):
            raise ManifestRefused("; ".join(dict.fromkeys(refused.values())))
        why_not = [*dict.fromkeys(refused.values()), *(["some had none yet"] if none_yet else [])]
        raise PeerUnavailable("none answered with one" + (f" ({'; '.join(why_not)})" if why_not else ""))

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """`NetLoop.call`, or NetworkError once the node has stopped by itself."""
        self._check_up(coro)
        return super().call(coro, timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future:
        """`NetLoop.submit`, or NetworkError once the node has stopped by itself."""
        self._check_up(coro)
        return super().submit(coro)

    @property
    def down(self) -> str | None:
        """Why the running node stopped by itself (None: it runs, or was closed as asked)."""
        return self._down

    @property
    def failure(self) -> BaseException | None:
        """What stopped the running node by itself (None: it runs, or was closed as asked)."""
        return self._error if self._down is not None else None

    def _check_up(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self._down is not None:
            coro.close()  # never to run: no "never awaited" warning
            raise NetworkError(self._down)

    def _raise_if_down(self) -> None:
        """A `call` under way when the node stops by itself ends at once (the coordinator's wait
        for a round's decision went on, on a dead daemon, for its whole 96 s bound)."""
        if self._down is not None:
            raise NetworkError(self._down)

    def close(self) -> None:
        """Stop every task, shut the daemon down and join the thread (idempotent)."""
        if self._loop.is_closed():
            return
        if self._loop.is_running():
            # Still starting (a Ctrl+C during a slow DHT bootstrap, say): the start-up is
            # cancelled, not waited for (up to 20 s), and its teardown below runs at once.
            self._loop.call_soon_threadsafe(self._stop_soon)
        try:
            if self._main is not None:
                self._main.result(timeout=20)
        except CancelledError:  # a start-up cancelled (`_stop_soon`), its teardown done
            pass
        except Exception as exc:  # shutting down: nothing left to decide, say what happened
            log.warning("network shutdown: %r", exc)
        finally:  # a Ctrl+C during the wait too: the loop and its thread are not left behind
            self.stop_loop()

    def _stop_soon(self) -> None:
        """(On the loop.) Stop the running node, or cancel its start-up."""
        if self._ready.is_set() and self._stop is not None:
            self._stop.set()
            return
        self._start_cancelled = True  # `_run` has not begun: it never will
        if self._run_task is not None:
            self._run_task.cancel()  # its teardown (the finally) still runs, and `close` waits for it

class ManifestRefused(PeerUnavailable):
    """Every bootstrap peer answered with a manifest that cannot be taken (signed by another key,
    say): the message says why."""


class _Stop(Exception):
    """Raised inside the node's TaskGroup to cancel every task on close."""
