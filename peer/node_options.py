"""How a peer's node listens, whom it asks first, and what it offers the run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class NodeOptions:
    """How the node listens and whom it asks first."""

    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: Sequence[str] = ()
    initial_peers: Sequence[str] = ()
    coordinator: str = ""  # the run's coordinator's peer id, if known: its dial-back probe is trusted first
    role: str = "volunteer"
    trains: bool = True
    serves: bool = True  # offer to aggregate and lead; dropped if the peer turns out to be unreachable
    reachability: str = "auto"  # "auto" (dial-back probe by a bootstrap peer), "public" or "private"
    direct_state: bool = True  # also serve the state sealed over plain TCP (see protocol/direct.py)
    direct_port: int = 0  # its TCP port (0: any free one), on the first listen address's IP
    hole_punch: bool = True  # behind a NAT: punch holes to other NAT'ed peers (see peer/holepunch.py)
    relay_slot: bool = True  # behind a NAT: hold a relay reservation, so that others can open streams to us


def reader_options(initial_peers: Sequence[str], coordinator: str) -> NodeOptions:
    """A passing reader's node (`groundswell status`): a DHT client only. No dial-back probe, no
    relay slot, nothing served to the run: asked every few seconds, it must cost the run nothing."""
    return NodeOptions(initial_peers=initial_peers, coordinator=coordinator, trains=False, serves=False,
                       reachability="private", direct_state=False, hole_punch=False, relay_slot=False)
