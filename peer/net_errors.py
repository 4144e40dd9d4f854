"""What a user is told when the network does not start: one line that says what to do."""

from __future__ import annotations

import re
from collections.abc import Sequence


class NetworkError(RuntimeError):
    """The network could not start, or the run could not be reached: a message for the user."""


class DaemonExited(NetworkError):
    """The libp2p daemon of a running node exited (a Go panic, the out-of-memory killer)."""


def clock_skew(message: str) -> float | None:
    """Our clock minus a peer's, from hivemind's DHT refusal ("local time must be within 3 seconds
    of others(local: L, peer: P)"), or None for any other message."""
    found = re.search(r"local time must be within .*local: ([0-9.]+), peer: ([0-9.]+)", message)
    return float(found.group(1)) - float(found.group(2)) if found else None


def explain_start_failure(err: BaseException, initial_peers: Sequence[str], role: str = "volunteer") -> NetworkError:
    """The NetworkError to raise for a failed start of the daemon or the DHT (`role`: the node's,
    for advice that names flags its command has)."""
    if isinstance(err, NetworkError):
        return err
    text = str(err)
    if (skew := clock_skew(text)) is not None:  # hivemind's DHT allows 3 s
        # One decimal: "3 s ahead, and the DHT allows 3 s" read as no reason at all for 3.3 s.
        return NetworkError(f"this computer's clock is {abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} "
                            "the bootstrap peer's, and the DHT allows 3 s: set the clock (turn on "
                            "network time, e.g. `timedatectl set-ntp true`) and start again; if this "
                            "clock is right, the bootstrap peer's is off (tell the run's coordinator)")
    if "can't access this node" in text:  # hivemind's DHT: the bootstrap peer could not dial us back
        fix = ("forward the --listen port, and name the address others reach with --announce" if role == "coordinator"
               else "then --reachability private")
        return NetworkError(f"the bootstrap peer could not connect back to this node (a firewall? {fix}; or "
                            "another process with the same identity)")
    if "none of the initial_peers responded to a ping" in text:  # connected, but no DHT answer (dht_entry.enter_dht)
        within = re.search(r"in ([0-9.]+) s", text)
        return NetworkError(f"the bootstrap peers ({', '.join(initial_peers)}) took the connection but their DHT "
                            f"did not answer within {within.group(1) if within else 3} s (overloaded, or frozen?): "
                            "start again in a moment")
    if "failed to connect to bootstrap peers" in text:  # p2pd's words
        return NetworkError(f"none of the bootstrap peers answered ({', '.join(initial_peers)}): is the run up, "
                            "and is the address right?")
    return NetworkError(f"could not start the network: {err}")
