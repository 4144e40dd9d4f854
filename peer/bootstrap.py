"""The bootstrap string a coordinator prints and volunteers paste: the coordinator's peer id (the
key every peer checks the run manifest's signature against) and the multiaddrs of live peers,
`gs1:<coordinator>@<maddr>[,<maddr>...]`, or a plain multiaddr ending in /p2p/<coordinator>."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from groundswell.protocol.identity import IdentityError, public_key_from_peer_id


class BootstrapError(ValueError):
    """A bootstrap string (or one of its multiaddrs) is malformed."""


BOOTSTRAP_PREFIX = "gs1:"
MAX_BOOTSTRAP_MADDRS = 32
_MAX_BOOTSTRAP_CHARS = 8192


@dataclass(frozen=True)
class Bootstrap:
    """Where to join a run: the coordinator's peer id and multiaddrs of live peers."""

    coordinator_id: str
    maddrs: tuple[str, ...]

    def __str__(self) -> str:
        return format_bootstrap(self.coordinator_id, self.maddrs)


def format_bootstrap(coordinator_id: str, maddrs: Sequence[str]) -> str:
    """`gs1:<coordinator>@<maddr>[,<maddr>...]`, validated so that `parse_bootstrap` accepts it."""
    # hivemind hands out Multiaddr objects, at times one twice; a host with many interfaces lists
    # more than a line may carry: the first ones do (a joiner needs one that works)
    maddrs = list(dict.fromkeys(str(m) for m in maddrs))[:MAX_BOOTSTRAP_MADDRS]
    bootstrap = _checked(coordinator_id, maddrs)
    return f"{BOOTSTRAP_PREFIX}{bootstrap.coordinator_id}@{','.join(bootstrap.maddrs)}"


def parse_bootstrap(text: str) -> Bootstrap:
    """Parse `gs1:<coordinator>@<maddr>,...` or a plain multiaddr `/.../p2p/<coordinator>`."""
    if not isinstance(text, str):
        raise BootstrapError(f"a bootstrap string is text, got {type(text).__name__}")
    text = text.strip()  # pasted from a terminal
    if len(text) > _MAX_BOOTSTRAP_CHARS:
        raise BootstrapError(f"bootstrap string is longer than {_MAX_BOOTSTRAP_CHARS} characters")
    if text.startswith("/"):
        maddr = _check_maddr(text)
        return _checked(maddr.rsplit("/p2p/", 1)[1], [maddr])
    if re.match(r"gs\d+:", text) and not text.startswith(BOOTSTRAP_PREFIX):
        raise BootstrapError(f"unsupported bootstrap version {text.split(':', 1)[0]!r}; this peer reads gs1")
    if not text.startswith(BOOTSTRAP_PREFIX):
        raise BootstrapError(
            "a bootstrap string looks like 'gs1:<coordinator peer id>@<multiaddr>[,<multiaddr>...]' "
            "or a multiaddr ending in /p2p/<coordinator peer id>"
        )
    coordinator_id, at, maddr_list = text[len(BOOTSTRAP_PREFIX) :].partition("@")
    if not at or not maddr_list:
        raise BootstrapError("bootstrap string has no '@<multiaddr>' after the coordinator id")
    return _checked(coordinator_id, [m.strip() for m in maddr_list.split(",")])


def _checked(coordinator_id: str, maddrs: Sequence[str]) -> Bootstrap:
    try:
        public_key_from_peer_id(coordinator_id)
    except IdentityError as exc:
        raise BootstrapError(f"the coordinator's id in the bootstrap line is not a valid peer id ({exc}): "
                             "copy the whole line `launch` printed again (mistyped?)") from None
    if not maddrs:
        raise BootstrapError("a bootstrap string needs at least one multiaddr")
    if len(maddrs) > MAX_BOOTSTRAP_MADDRS:
        raise BootstrapError(
            f"a bootstrap string has at most {MAX_BOOTSTRAP_MADDRS} multiaddrs, got {len(maddrs)}"
        )
    checked = tuple(_check_maddr(m) for m in maddrs)
    if len(set(checked)) != len(checked):
        raise BootstrapError("bootstrap string lists a multiaddr twice")
    return Bootstrap(coordinator_id, checked)


def peer_id_of(maddr: str) -> str:
    """The peer id a checked multiaddr names: its last /p2p/ (a relay circuit's first is the
    relay's), also where it is spelled /ipfs/."""
    from hivemind.utils.multiaddr import Multiaddr

    return str(Multiaddr(maddr)).rsplit("/p2p/", 1)[1]


def check_maddr_flag(flag: str, texts: Sequence[str], peer_id: bool = False) -> None:
    """Refuse a malformed multiaddr given with `flag` (--listen, --announce, --peer) in one line;
    one for --peer (`peer_id`) must be a peer address as a bootstrap string's are."""
    from hivemind.utils.multiaddr import Multiaddr

    for text in texts:
        try:
            protocols = [p.name for p in Multiaddr(text).protocols()]
        except Exception as exc:  # the parser's own errors are of several types
            raise BootstrapError(f"{flag}: {exc}") from None
        if peer_id and (len(protocols) < 2 or protocols[-1] != "p2p"):  # peers are dialled by id
            raise BootstrapError(f"{flag} {text!r} must end in /p2p/<peer id>")
        if peer_id:
            try:
                _check_maddr(text)
            except BootstrapError as exc:
                raise BootstrapError(f"{flag}: {exc}") from None
        elif flag == "--announce" and ("p2p" in protocols or not _TRANSPORTS & set(protocols)):
            # (it goes into the line volunteers paste, with our id appended)
            raise BootstrapError(f"{flag} {text!r} must be an address others dial, with a transport (tcp, or "
                                 "udp with quic) and no /p2p/")


def _check_maddr(text: str) -> str:
    from hivemind.utils.multiaddr import Multiaddr

    if not text:
        raise BootstrapError("empty multiaddr in bootstrap string")
    try:
        maddr = Multiaddr(text)
        protocols = [p.name for p in maddr.protocols()]
        canonical = str(maddr)  # (it parses some texts it cannot print: a NUL in a name, a bad peer id length)
    except Exception as exc:
        raise BootstrapError(f"invalid multiaddr {text!r}: {exc}") from None
    # libp2p dials bootstrap peers by id, so every address must say whose it is
    if len(protocols) < 2 or protocols[-1] != "p2p":
        raise BootstrapError(f"multiaddr {text!r} must end in /p2p/<peer id>")
    # One peer's id, or a relay's then the peer's around /p2p-circuit (the peer's is the last)
    circuit = protocols.count("p2p-circuit")
    if circuit > 1 or protocols.count("p2p") != 1 + circuit or (circuit and protocols[-2] != "p2p-circuit"):
        raise BootstrapError(f"multiaddr {text!r} must name one peer: .../p2p/<id>, or a relay's "
                             ".../p2p/<relay id>/p2p-circuit/p2p/<id>")
    if not _TRANSPORTS & set(protocols) and protocols[0] != "dnsaddr":  # (p2pd resolves a dnsaddr)
        raise BootstrapError(f"multiaddr {text!r} names no transport to dial (tcp, or udp with quic)")
    return canonical


_TRANSPORTS = {"tcp", "quic", "quic-v1"}
