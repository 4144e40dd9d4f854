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
from groundswell.compression.wire_bounds import count_objects
from groundswell.compression.wire_pack import bin_header, pack

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
    return pack([PROTOCOL_VERSION, run_id, env.sender, env.nonce, env.timestamp, env.body, sig])


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
        count_objects(data, 16)  # an array of 7 scalars (a few more: a bad version gets its own error)
        obj = msgpack.unpackb(data, raw=False, use_list=True, max_bin_len=len(data), max_str_len=512,
                              max_array_len=8, max_map_len=0, max_ext_len=0)
    except MemoryError:  # ours, not the sender's fault: no strike for it
        raise
    except Exception as exc:  # msgpack raises many unrelated types on bad input
        raise ProtocolError(f"not a valid envelope: {exc}") from None
    if not isinstance(obj, list) or len(obj) != 7:
        raise ProtocolError("an envelope has 7 fields")
    version, env_run, env_sender, nonce, ts, body, sig = obj
    if type(version) is not int or version != PROTOCOL_VERSION:  # True and 1.0 equal 1 in Python
        raise ProtocolError(f"protocol version {brief(version)}; this peer speaks {PROTOCOL_VERSION}", reason="version")
    if not (isinstance(env_run, str) and isinstance(env_sender, str) and isinstance(nonce, bytes)
            and isinstance(ts, float) and isinstance(body, bytes) and isinstance(sig, bytes)):
        raise ProtocolError("envelope fields have the wrong types")
    # Only the one encoding `seal` writes is accepted: the signature covers the decoded fields, and
    # peers use a signed commit's bytes as its identity, so a relay must not be able to re-spell it.
    head = b"\x97" + b"".join(msgpack.packb(v, use_bin_type=True) for v in (version, env_run, env_sender, nonce, ts))
    body_head = bin_header(len(body))
    body_at = len(head) + len(body_head)
    if (not data.startswith(head) or data[len(head):body_at] != body_head
            or data[body_at + len(body):] != msgpack.packb(sig, use_bin_type=True)):
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


def sealed_message(data: bytes, expect: Any) -> bytes:
    """The message inside an envelope, decoded (strictly) and encoded again: the same bytes for the
    same message however it was sealed (each seal has its own nonce and time) or spelled (msgpack
    has several spellings of a number, which decoding accepts). The signature is not checked:
    for envelopes already unsealed."""
    try:
        count_objects(data, 16)  # as `unseal`: safe on bytes nobody checked (nested arrays cost ~64x)
        obj = msgpack.unpackb(data, raw=False, use_list=True, max_bin_len=len(data), max_str_len=512,
                              max_array_len=8, max_map_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises many unrelated types on bad input
        raise ProtocolError(f"not a valid envelope: {exc}") from None
    if not (isinstance(obj, list) and len(obj) == 7 and isinstance(obj[5], bytes)):
        raise ProtocolError("an envelope has 7 fields")
    return encode_message(decode_message(obj[5], expect))
