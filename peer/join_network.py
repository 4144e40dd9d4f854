"""What `join` asks of the network before it trains: the run's signed manifest, and telling the
volunteer how others reach it."""

from __future__ import annotations

from typing import Any

from .cli import console


def fetch_manifest(node: Any, maddrs: list[str], coordinator_id: str, launch: str | None = None) -> tuple[bytes, Any]:
    """The run manifest from the bootstrap peers (or, with those down, the peers the node entered
    the run through), signed by `coordinator_id` (the first one that verifies: the others are
    asked when one serves another's); NetworkError if none does. From peers other than the
    bootstrap peers, only the launch `launch` names (the state dir's binding, `manifest_digest`):
    any contributor is one of them, and could serve an older launch's, validly signed."""
    from groundswell.protocol.transport import PeerUnavailable

    from .manifest import ManifestError, SignedManifest
    from .net_errors import NetworkError

    def why_not(signed: bytes) -> str | None:
        try:
            SignedManifest.from_bytes(signed).verify(coordinator_id)
        except ManifestError as exc:
            return str(exc)
        if node.entered_through and launch and manifest_digest(signed) != launch:
            return "not the launch of the run this state dir holds"
        return None

    from .swarm import ManifestRefused

    try:
        asked = node.entered_through or [m.rsplit("/p2p/", 1)[1] for m in maddrs]
        signed = node.call(node.fetch_manifest(asked, accept=why_not), timeout_s=120)
    except ManifestRefused as exc:  # not the network's doing: the manifest itself, in one line
        raise ManifestError(str(exc)) from None
    except (PeerUnavailable, TimeoutError) as exc:
        asked_whom = (f"none of the {len(asked)} peer(s) of the run known from before (the bootstrap peers are down)"
                      if node.entered_through else f"no bootstrap peer ({', '.join(maddrs)})")
        raise NetworkError(f"{asked_whom} served the run manifest: {exc}") from None
    return signed, SignedManifest.from_bytes(signed).verify(coordinator_id)


def manifest_digest(signed: bytes) -> str:
    """The signed manifest's digest: names one launch of a run (a resumed one signs it again alike)."""
    from .manifest import SignedManifest

    return SignedManifest.from_bytes(signed).digest


def say_reachability(node: Any, peers: list[str]) -> None:
    """Tell the volunteer how others reach it, now and once a hole punch works."""
    relays = ", ".join(pid[-8:] for pid in peers[:3])  # trusted relays: the bootstrap peers
    if node.entered_through:
        console.print(f"[yellow]no bootstrap peer answered[/]: in the run through {len(node.entered_through)} "
                      "peer(s) known from before", highlight=False)
    if node.reachability == "public":
        console.print("reachable: public (other peers can connect to us)")
    elif node.entered_through:
        console.print("reachable: private (no bootstrap peer answered our probe: the run's peers found us "
                      "private, or gave no verdict, one peer's word being none)"
                      + ("; no relay slot while the bootstrap peers are down" if node.bootstrap_down else "")
                      + "; contributing, not serving")  # (its relays are the bootstrap peers)
    else:
        console.print(f"reachable: behind a NAT, through relay {relays} once it holds our slot (libp2p "
                      "reserves it within seconds), and directly by peers behind other NATs after hole "
                      "punching where their NAT allows; contributing, not serving")
    node.announce_punch = lambda peer, addr: console.print(
        f"reachable: also directly by {peer[-8:]} (behind a NAT too), after hole punching", highlight=False)
