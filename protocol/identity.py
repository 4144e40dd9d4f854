"""Ed25519 identities bound to libp2p peer ids.

A peer's identity file is the libp2p protobuf private key, so the same file both signs our
messages and is handed to `P2P.create(identity_path=...)`: the signer of a message and the libp2p
peer it arrived from are then provably the same. Ed25519 peer ids embed the public key (identity
multihash), so anyone can check a signature from the peer id alone, with no key exchange.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from pathlib import Path
from typing import Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PathLike = Union[str, "os.PathLike[str]"]

log = logging.getLogger(__name__)
SIGNATURE_BYTES = 64
_KEY_BYTES = 32
_MAX_IDENTITY_FILE = 4096  # a real one is 68 bytes; anything much larger is not an identity file
_MAX_PEER_ID_CHARS = 128
_IDENTITY_MULTIHASH = 0x00
_SHA256_MULTIHASH = 0x12


class IdentityError(ValueError):
    """An identity file, public key or peer id is malformed or of an unsupported kind."""


def _crypto_pb2():  # hivemind's package import pulls in torch, so defer it to first use
    from hivemind.proto import crypto_pb2

    return crypto_pb2


def peer_id_from_public_bytes(public_bytes: bytes) -> str:
    """The libp2p peer id (base58, `12D3KooW...`) of a raw 32-byte Ed25519 public key."""
    if len(public_bytes) != _KEY_BYTES:
        raise IdentityError(f"an Ed25519 public key is {_KEY_BYTES} bytes, got {len(public_bytes)}")
    from hivemind.p2p import PeerID

    pb = _crypto_pb2()
    encoded = pb.PublicKey(key_type=pb.Ed25519, data=bytes(public_bytes)).SerializeToString()
    # keys this short are embedded verbatim ("identity" multihash) rather than hashed
    return PeerID(bytes([_IDENTITY_MULTIHASH, len(encoded)]) + encoded).to_base58()


def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 public key embedded in a peer id; IdentityError if there is none."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
        raise IdentityError(f"a peer id is a base58 string of at most {_MAX_PEER_ID_CHARS} chars")
    return _public_key_from_peer_id(peer_id)


@functools.lru_cache(maxsize=4096)  # every incoming signed message looks its sender's key up
def _public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    from hivemind.p2p import PeerID

    try:
        parsed = PeerID.from_base58(peer_id)
    except ValueError:
        raise IdentityError(f"peer id {peer_id!r} is not valid base58") from None
    if parsed.to_base58() != peer_id:  # the decoder strips whitespace: "id " would be a second id
        raise IdentityError(f"peer id {peer_id!r} is not canonically spelled")
    raw = parsed.to_bytes()
    if len(raw) >= 2 and raw[0] == _SHA256_MULTIHASH:
        raise IdentityError(
            f"peer id {peer_id!r} is a hash of its key (an RSA-style 'Qm...' id), so its public key "
            "cannot be recovered; groundswell peers need Ed25519 ids ('12D3KooW...')"
        )
    if len(raw) < 2 or raw[0] != _IDENTITY_MULTIHASH or raw[1] != len(raw) - 2:
        raise IdentityError(f"peer id {peer_id!r} is not an identity multihash")
    pb = _crypto_pb2()
    key = pb.PublicKey()
    try:
        key.ParseFromString(raw[2:])
    except Exception:
        raise IdentityError(f"peer id {peer_id!r} does not hold a protobuf public key") from None
    if key.key_type != pb.Ed25519 or len(key.data) != _KEY_BYTES:
        raise IdentityError(f"peer id {peer_id!r} is not an Ed25519 key")
    # re-encoding must reproduce the id exactly: no extra fields, no alternative spellings
    if pb.PublicKey(key_type=pb.Ed25519, data=key.data).SerializeToString() != raw[2:]:
        raise IdentityError(f"peer id {peer_id!r} is not canonically encoded")
    if bytes(key.data) in _SMALL_ORDER_KEYS:  # signatures "verify" for these without any private key
        raise IdentityError(f"peer id {peer_id!r} holds a small-order Ed25519 key")
    # y >= p spells a point twice (y - p is the canonical spelling), and y = p, p + 1 are small
    # order: OpenSSL accepts such keys, so one key must not have two peer ids
    if int.from_bytes(key.data, "little") & ((1 << 255) - 1) >= _P:
        raise IdentityError(f"peer id {peer_id!r} holds a non-canonical Ed25519 key")
    return Ed25519PublicKey.from_public_bytes(key.data)


# Encodings of the 8 small-order points of edwards25519 (with their sign-bit twins and the
# non-canonical spellings of y = 0, y = 1 and y = -1): no honest key is one of them.
_SMALL_ORDER_KEYS = frozenset(bytes.fromhex(h) for h in (
    "01" + "00" * 31, "01" + "00" * 30 + "80",
    "ec" + "ff" * 30 + "7f", "ec" + "ff" * 31,
    "00" * 32, "00" * 31 + "80",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
    "ee" + "ff" * 30 + "7f", "ee" + "ff" * 31,
    "ed" + "ff" * 30 + "7f", "ed" + "ff" * 31,
))
_P = (1 << 255) - 19  # the field prime of edwards25519


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True iff `signature` is `peer_id`'s Ed25519 signature of `data`; never raises."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return False
    if not isinstance(signature, (bytes, bytearray, memoryview)) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        public_key_from_peer_id(peer_id).verify(bytes(signature), bytes(data))
    except (IdentityError, InvalidSignature, TypeError):
        return False
    return True


class Identity:
    """An Ed25519 private key with its libp2p peer id."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_bytes: bytes = private_key.public_key().public_bytes_raw()
        self.peer_id: str = peer_id_from_public_bytes(self.public_bytes)

    def __repr__(self) -> str:  # never the key itself
        return f"Identity({self.peer_id})"

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_key(self) -> Ed25519PublicKey:
        """The public half of the key."""
        return self._key.public_key()

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `data`."""
        return self._key.sign(bytes(data))

    def to_libp2p_bytes(self) -> bytes:
        """The libp2p protobuf private key: seed (32) followed by public key (32)."""
        pb = _crypto_pb2()
        data = self._key.private_bytes_raw() + self.public_bytes
        return pb.PrivateKey(key_type=pb.Ed25519, data=data).SerializeToString()

    @classmethod
    def from_libp2p_bytes(cls, data: bytes) -> Identity:
        """Parse a libp2p protobuf private key strictly; IdentityError if it is not Ed25519."""
        pb = _crypto_pb2()
        msg = pb.PrivateKey()
        try:
            msg.ParseFromString(bytes(data))
        except Exception:
            raise IdentityError("not a libp2p private key (protobuf does not parse)") from None
        if not msg.IsInitialized():
            raise IdentityError("not a libp2p private key (key type or key data missing)")
        if msg.key_type != pb.Ed25519:
            name = pb.KeyType.Name(msg.key_type) if msg.key_type in pb.KeyType.values() else msg.key_type
            raise IdentityError(f"identity key type is {name}; groundswell needs an Ed25519 key")
        if len(msg.data) != 2 * _KEY_BYTES:
            raise IdentityError(f"Ed25519 key data must be {2 * _KEY_BYTES} bytes, got {len(msg.data)}")
        identity = cls(Ed25519PrivateKey.from_private_bytes(msg.data[:_KEY_BYTES]))
        if identity.public_bytes != msg.data[_KEY_BYTES:]:
            raise IdentityError("identity file is corrupt: its public key does not match its seed")
        if identity.to_libp2p_bytes() != bytes(data):
            raise IdentityError("identity file has trailing or unknown fields")
        return identity

    @classmethod
    def load(cls, path: PathLike) -> Identity:
        """Read an identity file (libp2p protobuf private key)."""
        with open(path, "rb") as f:
            data = f.read(_MAX_IDENTITY_FILE + 1)
            mode = os.fstat(f.fileno()).st_mode
        if len(data) > _MAX_IDENTITY_FILE:
            raise IdentityError(f"{os.fspath(path)} is too large to be an identity file")
        try:
            identity = cls.from_libp2p_bytes(data)
        except IdentityError as exc:
            raise IdentityError(f"{os.fspath(path)}: {exc}") from None
        # only of a key: a file that is none (a README passed by mistake) is told so alone
        if os.name == "posix" and mode & 0o077:  # as ssh does: said, not refused (a container's volume, say)
            log.warning("%s can be read by other users (mode %o): anyone who can read it can sign as this peer; "
                        "chmod 600 it", os.fspath(path), mode & 0o777)
        return identity

    def save(self, path: PathLike, overwrite: bool = False) -> None:
        """Write the identity file atomically with mode 0600; FileExistsError unless `overwrite`."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.to_libp2p_bytes())
                f.flush()
                os.fsync(f.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                # link() fails if the target exists, so there is no check-then-write race
                try:
                    os.link(tmp, path)
                    os.unlink(tmp)
                except FileExistsError:
                    raise FileExistsError(
                        f"{path} already exists; refusing to overwrite an identity"
                    ) from None
                except OSError:  # a filesystem without hard links: check, then rename (racy, but rare)
                    if path.exists():
                        raise FileExistsError(f"{path} already exists; refusing to overwrite an identity")
                    os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)  # the new name survives a power loss, not only the bytes

    @classmethod
    def load_or_generate(cls, path: PathLike) -> Identity:
        """Load the identity at `path`, creating and saving a new one if there is no file."""
        try:
            return cls.load(path)
        except FileNotFoundError:
            pass
        identity = cls.generate()
        try:
            identity.save(path)
        except FileExistsError:  # another process created it meanwhile: theirs wins
            return cls.load(path)
        return identity


def _fsync_dir(path: Path) -> None:
    """Make a new directory entry in `path` durable; a filesystem that cannot is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory: nothing more can be done there
        pass
    finally:
        os.close(fd)
