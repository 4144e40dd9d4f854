"""Signed envelopes: every request and reply of the protocol is a schema message inside an
`Envelope` that names the run, the sender (an Ed25519 peer id, which embeds its public key), a
nonce and a time, signed by the sender over all of it. `unseal` checks all of that, and the
message strictly, before anything is decoded further."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .digests import bulk_digest
from .identity import Identity, verify
from .schema import (
    MAX_SMALL,
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    brief,
    decode_message,
    encode_message,
    packb,
    strict_unpacker,
)


@dataclass(frozen=True)
class Envelope:
    """A signed message: who sent it, for which run, when, and the signature over all of it."""

    run_id: str
    sender: str
    nonce: bytes
    timestamp: float
    body: bytes
    signature: bytes

    def signed_part(self) -> bytes:
        """The canonical bytes the signature covers: the header and the body's BLAKE3 digest.
        Signing the digest, not the body, keeps a 25 MB contribution to one fast hash pass
        (Ed25519 hashes what it signs twice, with SHA-512, and the body would be copied once more
        to frame it)."""
        return msgpack.packb(
            [PROTOCOL_VERSION, self.run_id, self.sender, self.nonce, self.timestamp, bulk_digest(self.body)],
            use_bin_type=True,
        )


def seal(identity: Identity, run_id: str, msg: Message) -> bytes:
    """Sign a message for a run and serialize the envelope."""
    env = Envelope(run_id, identity.peer_id, os.urandom(16), time.time(), encode_message(msg), b"")
    sig = identity.sign(env.signed_part())
    return packb([PROTOCOL_VERSION, run_id, env.sender, env.nonce, env.timestamp, env.body, sig], len(env.body))


def unseal(data: bytes, run_id: str, expect: Any, max_bytes: int = MAX_SMALL, sender: str | None = None,
           fresh: Callable[[bytes, float], None] | None = None) -> tuple[str, Any]:
    """Verify an envelope (run, signature, optional sender, and `fresh(nonce, time)` once the
    signature holds) and decode its message strictly."""
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("an envelope must be bytes")
    if len(data) > max_bytes + 512:
        raise ProtocolError(f"envelope is {len(data)} bytes, over the limit", reason="oversized")
    data = bytes(data)
    try:
        u = strict_unpacker(data, max_str=512)
        if u.read_array_header() != 7:
            raise ProtocolError("an envelope has 7 fields")
        version, env_run, env_sender, nonce, ts = (_leaf(u, name) for name in _HEADER)
        body_at = u.tell()
        body = u.unpack()
        sig_at = u.tell()
        sig = u.unpack()
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many unrelated types on bad input
        raise ProtocolError(f"not a valid envelope: {exc}") from None
    if type(version) is not int or version != PROTOCOL_VERSION:  # True and 1.0 equal 1 in Python
        raise ProtocolError(f"protocol version {brief(version)}; this peer speaks {PROTOCOL_VERSION}", reason="version")
    if not (isinstance(env_run, str) and isinstance(env_sender, str) and isinstance(nonce, bytes)
            and isinstance(ts, float) and isinstance(body, bytes) and isinstance(sig, bytes)):
        raise ProtocolError("envelope fields have the wrong types")
    # Only the one encoding `seal` writes is accepted: the signature covers the decoded fields, and
    # peers use a signed commit's bytes as its identity, so a relay must not be able to re-spell it.
    head = b"\x97" + b"".join(msgpack.packb(v, use_bin_type=True) for v in (version, env_run, env_sender, nonce, ts))
    if (data[:body_at] != head or sig_at - body_at - len(body) != _bin_header_bytes(len(body))
            or data[sig_at:] != msgpack.packb(sig, use_bin_type=True)):
        raise ProtocolError("envelope is not canonically encoded")
    if env_run != run_id:
        raise ProtocolError(f"message is for run {env_run!r}, not {run_id!r}", reason="wrong-run")
    if sender is not None and env_sender != sender:
        raise ProtocolError("envelope sender is not the stream's peer", reason="bad-signature")
    env = Envelope(env_run, env_sender, nonce, ts, body, sig)
    if not verify(env_sender, env.signed_part(), sig):
        raise ProtocolError("bad signature", reason="bad-signature")
    if fresh is not None:
        fresh(nonce, ts)
    return env_sender, decode_message(body, expect, max_bytes=max_bytes)


_HEADER = ("protocol version", "run", "sender", "nonce", "time")


def _leaf(u: Any, name: str) -> Any:
    try:
        return u.unpack()
    except ValueError:  # a list or map where a single value belongs: refused before it is built
        raise ProtocolError(f"envelope field {name!r} must be a single value") from None


def _bin_header_bytes(length: int) -> int:
    """Bytes of the shortest msgpack bin header for `length` bytes (bin8, bin16 or bin32)."""
    return 2 if length < 1 << 8 else 3 if length < 1 << 16 else 5
