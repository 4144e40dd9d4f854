"""Why a request to a peer failed, as the caller acts on it: the peer is unavailable (slow,
frozen, or broke the protocol), gone (there, but not answering: it refused or closed), or dead
(no stream could be opened: its process is gone); and how daemon errors map onto these.
"""

from __future__ import annotations

from typing import Any

# Daemon errors that mean no stream could be opened at all (see `PeerDead`), on either path;
# others ("stream reset") come from a stream that was open.
_DIAL_FAILURES = ("failed to dial", "failed to negotiate protocol", "routing: not found", "no addresses",
                  "protocols not supported", "failed to find any peer in table", "failed to open stream",
                  "connection failed")


def dial_failed(exc: BaseException) -> bool:
    """Whether the daemon said no stream to the peer could be opened (a failed dial, an unserved
    protocol): the peer's process is gone. Not our own daemon's socket failing, nor a bug of ours."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    return isinstance(exc, P2PDaemonError) and any(m in str(exc) for m in _DIAL_FAILURES)


def target_peer_id(peer_id: str, handler: str) -> Any:
    """hivemind's PeerID for `peer_id`; `PeerDead` if it is not one (nothing could be dialled)."""
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_base58(peer_id)
    except ValueError as exc:
        raise PeerDead(f"{peer_id[-8:]} unavailable for {handler}: {exc!r}") from None


def remote_failure(exc: BaseException) -> bool:
    """Whether a failed request's error is one the other side (or the path to it) explains: a
    daemon error (a refusal, a reset), a connection reset, an early end of the stream. Not a
    refused connection: every request goes through our own daemon's socket, so that one is ours
    (the daemon died), and it must not take a grant from the peer."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

    if isinstance(exc, ConnectionRefusedError):
        return False
    return isinstance(exc, (P2PDaemonError, P2PHandlerError, ConnectionError, EOFError))


class PeerUnavailable(ConnectionError):
    """A request could not be completed: the peer is gone, frozen, or broke the protocol."""


class ShardsUnavailable(PeerUnavailable):
    """Some shards of a committed round could be had from no peer: `shards` says which."""

    def __init__(self, round_id: int, shards: list[int]) -> None:
        super().__init__(f"no peer could provide shard(s) {', '.join(map(str, shards))} of round {round_id}")
        self.shards = shards


class RequestTimedOut(PeerUnavailable):
    """No reply within the request's time: the peer is slow or frozen, or what we sent was (a
    slow uplink), not known to be gone."""


class PeerGone(PeerUnavailable):
    """The peer is not there: the dial failed, it does not serve the protocol (yet), or it closed
    the stream unanswered; unlike a timeout, not a peer that may merely be slow or frozen."""


class PeerDead(PeerGone):
    """No stream could be opened at all: the dial failed or the peer's daemon does not serve the
    protocol. Its process is gone, or is a new one starting without the old one's memory. (A
    stream closed unanswered is only `PeerGone`: a live peer's flood limits do that too.)"""


class Refused(Exception):
    """An inbound unary request we do not answer; the caller sees it end unanswered (`PeerGone`)."""
