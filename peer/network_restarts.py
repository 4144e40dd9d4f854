"""When a running peer's libp2p daemon dies under it (a Go panic, the out-of-memory killer), the
peer starts a fresh one and carries on from its state dir, as a restarted process would: a
volunteer's work is on disk (`roles._saved_if_the_network_fails`), the coordinator's checkpoint
too (`coordinator_role.run_coordinator`), and the swarm does not wait for either. Bounded: a
daemon that dies again at once every time (or a new one that cannot start) ends the peer with
its reason, instead of a loop of restarts. `join` and `launch` (cli_swarm.py) drive it."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from groundswell.protocol.identity import Identity

from .net_errors import DaemonExited, NetworkError
from .node_options import NodeOptions
from .reachability import busy_listen_address
from .stop_flag import StopFlag
from .swarm import SwarmNode

RESTARTS = 5  # at most this many ...
WINDOW_S = 600.0  # ... within this long
FIRST_WAIT_S = 1.0  # the first restart's wait; each next one within the window waits twice as long
MAX_WAIT_S = 30.0


@dataclass
class RestartBudget:
    """How many network restarts are left, and how long to wait before the next one."""

    limit: int = RESTARTS
    window_s: float = WINDOW_S
    first_wait_s: float = FIRST_WAIT_S
    max_wait_s: float = MAX_WAIT_S
    _times: list[float] = field(default_factory=list)

    def next_wait(self, now: float) -> float | None:
        """Seconds to wait before restarting (the restart is counted), or None when `limit`
        restarts happened within the last `window_s` seconds."""
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.limit:
            return None
        wait = min(self.max_wait_s, self.first_wait_s * 2 ** len(self._times))
        self._times.append(now)
        return wait

    @property
    def used(self) -> int:
        """Restarts within the window, as of the last `next_wait`."""
        return len(self._times)


def run_restarting(run: Callable[[], None], failure: Callable[[], BaseException | None],
                   stopped: Callable[[BaseException], None], start: Callable[[BaseException, float], None],
                   stop: StopFlag, budget: RestartBudget | None = None) -> bool:
    """`run()` until it returns (True). When it raises NetworkError because the node's daemon
    exited (`failure()` is a DaemonExited): `stopped(why)` once (save what the old node counted,
    close it), then `start(why, wait)` (wait unless stopped, then a new node; NetworkError if
    that fails: one more restart counted) and `run()` again. False: stopped while the network
    was down. Anything else goes up as it is."""
    budget = budget or RestartBudget()
    while True:
        try:
            run()
            return True
        except NetworkError:
            why = failure()
            if not isinstance(why, DaemonExited) or stop:
                raise
        # (out of the except block: its traceback, which holds the frames of the run that
        # failed and with them the old model and optimizer, is gone before a new one is built)
        stopped(why)
        while True:
            wait = budget.next_wait(time.monotonic())
            if wait is None:
                raise NetworkError(f"{why}; given up after {budget.limit} network restarts within "
                                   f"{budget.window_s / 60:g} min: start again once the cause is fixed")
            try:
                start(why, wait)
            except NetworkError as exc:  # the new node did not start
                why = exc
                if stop:
                    return False
                continue
            break
        if stop:
            return False


def restart_options(options: NodeOptions, maddrs: Sequence[str], reachability: str | None) -> NodeOptions:
    """The options of the node that replaces a stopped one (`options`, listening at `maddrs`,
    found `reachability`): each listen address that asked for any free port on the port it got,
    and the reachability it found. Peers dial the addresses they know: at a new port they meet
    libp2p's dial backoff on the old one, and a dial-back probe from such a peer failed, so the
    new node took itself for private (17 s into its start) and stopped serving. The machine's
    network has not changed: only its daemon died."""
    seen = []  # (family, ip, port) of the old daemon's plain TCP addresses
    for m in maddrs:
        parts = str(m).split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and "p2p-circuit" not in parts:
            seen.append((parts[1], parts[2], parts[4]))
    split = [str(m).split("/") for m in options.host_maddrs]
    taken = {p[4] for p in split if len(p) == 5 and p[3] == "tcp" and p[4] != "0"}
    hosts = []
    for parts in split:
        if len(parts) == 5 and parts[3] == "tcp" and parts[4] == "0":
            wildcard = parts[2] in ("0.0.0.0", "::")
            port = next((port for fam, ip, port in seen if fam == parts[1] and ip == parts[2] and port not in taken),
                        None) or next((port for fam, ip, port in seen if wildcard and fam == parts[1]
                                       and port not in taken), None)
            if port is not None:
                parts = [*parts[:4], port]
                taken.add(port)
        hosts.append("/".join(parts))
    known = reachability in ("public", "private") and options.reachability == "auto"
    return dataclasses.replace(options, host_maddrs=tuple(hosts),
                               reachability=reachability if known else options.reachability)


def restarted_node(identity: Identity, identity_path: str, old: SwarmNode, first: NodeOptions,
                   say: Callable[[str], None]) -> SwarmNode:
    """A started node in place of `old`, which stopped by itself: on its ports, with its
    reachability (`restart_options`), entering the DHT through the bootstrap peers `first`
    named (addresses from DHT records are no bootstrap peers, whose refusal can fail a start and
    who become relays; with every bootstrap peer down, it enters through the proven peers the old
    node knew: `dht_entry.enter_dht_through_proven`); on the ports `first` asked for (any free one) if another process
    took one of those meanwhile (`say` tells the user). NetworkError if it cannot start."""
    again = restart_options(old.options, old.maddrs, old.reachability)
    if (busy := busy_listen_address(again.host_maddrs)) is not None and busy_listen_address(first.host_maddrs) is None:
        say(f"cannot listen where the stopped network did ({busy}): on a new port")
        again = dataclasses.replace(again, host_maddrs=tuple(first.host_maddrs))
    node = SwarmNode(identity, identity_path, dataclasses.replace(again, initial_peers=tuple(first.initial_peers)))
    node.rejoiner.restore(old.rejoiner.remembered())  # entered through if every bootstrap peer is down
    node.start()
    return node


def release_memory(device: str) -> None:
    """Free what a dropped participant held (its node and it point at each other: a cycle only
    the collector frees), before a new one of the same size is built."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
