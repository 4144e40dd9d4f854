"""Ed25519 identities: the identity file is a libp2p private key, the peer id embeds the public key."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
from groundswell.protocol.identity import (
    Identity,
    IdentityError,
    peer_id_from_public_bytes,
    public_key_from_peer_id,
    verify,
)
from hivemind.proto import crypto_pb2

RSA_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a sha256-multihash id


@pytest.fixture(scope="module")
def ident() -> Identity:
    return Identity.generate()


def test_save_load_round_trip_and_mode(tmp_path, ident):
    path = tmp_path / "id.key"
    ident.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = Identity.load(path)
    assert loaded.peer_id == ident.peer_id and loaded.public_bytes == ident.public_bytes
    assert loaded.sign(b"m") == ident.sign(b"m")  # Ed25519 is deterministic: same key
    assert [p.name for p in tmp_path.iterdir()] == ["id.key"]  # no temp file left behind


def test_file_is_libp2p_protobuf(tmp_path, ident):
    path = tmp_path / "id.key"
    ident.save(path)
    msg = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    assert msg.key_type == crypto_pb2.Ed25519
    assert len(msg.data) == 64 and msg.data[32:] == ident.public_bytes


def test_save_refuses_overwrite(tmp_path, ident):
    path = tmp_path / "id.key"
    ident.save(path)
    other = Identity.generate()
    with pytest.raises(FileExistsError):
        other.save(path)
    assert Identity.load(path).peer_id == ident.peer_id
    other.save(path, overwrite=True)
    assert Identity.load(path).peer_id == other.peer_id
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(list(tmp_path.iterdir())) == 1


def test_load_or_generate(tmp_path):
    path = tmp_path / "id.key"
    first = Identity.load_or_generate(path)
    assert Identity.load_or_generate(path).peer_id == first.peer_id


def test_peer_id_format_and_key_extraction(ident):
    assert ident.peer_id.startswith("12D3KooW")
    assert public_key_from_peer_id(ident.peer_id).public_bytes_raw() == ident.public_bytes
    assert peer_id_from_public_bytes(ident.public_bytes) == ident.peer_id
    assert ident.peer_id in repr(ident)
    for _ in range(20):
        other = Identity.generate()
        assert public_key_from_peer_id(other.peer_id).public_bytes_raw() == other.public_bytes


@pytest.mark.parametrize(
    "bad",
    [RSA_PEER_ID, "", "0OIl", "héllo", "1", "12D3KooW", "x" * 500, None, b"12D3KooW", ["a"]],
)
def test_public_key_from_bad_peer_id(bad):
    with pytest.raises(IdentityError):
        public_key_from_peer_id(bad)


def test_public_key_from_non_ed25519_identity_multihash():
    from hivemind.p2p import PeerID

    pb = crypto_pb2.PublicKey(key_type=crypto_pb2.Secp256k1, data=b"\x02" * 33).SerializeToString()
    secp = PeerID(bytes([0, len(pb)]) + pb).to_base58()
    with pytest.raises(IdentityError, match="not an Ed25519"):
        public_key_from_peer_id(secp)
    # an Ed25519 key followed by an unknown protobuf field: parses, but is not canonical
    pb = (
        crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=b"\x01" * 32).SerializeToString() + b"\x18\x01"
    )
    with pytest.raises(IdentityError, match="canonical"):
        public_key_from_peer_id(PeerID(bytes([0, len(pb)]) + pb).to_base58())


def test_verify(ident):
    data = b"round 7 contribution"
    sig = ident.sign(data)
    assert verify(ident.peer_id, data, sig)
    assert verify(ident.peer_id, bytearray(data), memoryview(sig))
    assert not verify(ident.peer_id, data + b"!", sig)  # tampered data
    assert not verify(ident.peer_id, data, bytes([sig[0] ^ 1]) + sig[1:])  # tampered signature
    assert not verify(Identity.generate().peer_id, data, sig)  # wrong key
    assert not verify(ident.peer_id, data, sig[:-1])
    assert not verify(ident.peer_id, data, b"\x00" * 64)
    assert not verify(ident.peer_id, data, b"")
    assert not verify(RSA_PEER_ID, data, sig)
    assert not verify("garbage", data, sig)
    assert not verify(None, data, sig)  # type: ignore[arg-type]
    assert not verify(ident.peer_id, "text", sig)  # type: ignore[arg-type]
    assert not verify(ident.peer_id, data, None)  # type: ignore[arg-type]


def _rsa_identity_bytes() -> bytes:
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey()
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes()).SerializeToString()


def test_strict_identity_file(tmp_path, ident):
    good = ident.to_libp2p_bytes()
    cases = {
        "empty": b"",
        "truncated": good[:-1],
        "garbage": b"\xff\xfe not a key at all",
        "rsa": _rsa_identity_bytes(),
        "short key": crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=good[4:36]).SerializeToString(),
        "mismatched public key": crypto_pb2.PrivateKey(
            key_type=crypto_pb2.Ed25519, data=good[4:36] + b"\x00" * 32
        ).SerializeToString(),
        "trailing field": good + b"\x18\x01",
        "type only": crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519).SerializePartialToString(),
        "huge": b"\x00" * 10_000,
    }
    for name, data in cases.items():
        path = tmp_path / name.replace(" ", "_")
        path.write_bytes(data)
        with pytest.raises(IdentityError) as info:
            Identity.load(path)
        assert str(path) in str(info.value), name
    with pytest.raises(IdentityError, match="RSA"):
        Identity.from_libp2p_bytes(cases["rsa"])
    assert Identity.from_libp2p_bytes(good).peer_id == ident.peer_id
    with pytest.raises(FileNotFoundError):
        Identity.load(tmp_path / "missing")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_live_p2p_uses_the_identity(tmp_path):
    from hivemind.p2p import P2P

    ident = Identity.generate()
    path = tmp_path / "id.key"
    ident.save(path)

    async def main() -> str:
        # nat_port_map=False: never probe the local network; listen on loopback only
        p2p = await P2P.create(
            identity_path=str(path),
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            nat_port_map=False,
            check_if_identity_free=False,
        )
        try:
            return p2p.peer_id.to_base58()
        finally:
            await p2p.shutdown()

    assert asyncio.run(main()) == ident.peer_id
    assert Identity.load(path).peer_id == ident.peer_id  # p2pd left the file alone


def test_a_peer_id_holding_a_small_order_key_is_refused():
    # Found by the envelope fuzz test: an all-zero key accepts an all-zero signature.
    from groundswell.protocol.identity import IdentityError, public_key_from_peer_id, verify

    forged = "12D3KooW9pNAk8aiBuGVQtWRdbkLmo5qVL3e2h5UxbN2Nz9ttwiw"  # Ed25519 key 00..00
    with pytest.raises(IdentityError):
        public_key_from_peer_id(forged)
    assert not verify(forged, b"anything", bytes(64))


def test_save_makes_the_new_name_durable_too(tmp_path, ident, monkeypatch):
    # fsync of the file alone keeps its bytes; without an fsync of its folder a power loss can
    # lose the name, and the peer comes back as a stranger.
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    ident.save(tmp_path / "id.key")
    assert os.path.realpath(tmp_path) in synced


@pytest.mark.parametrize("key_hex", [
    "ed" + "ff" * 30 + "7f", "ed" + "ff" * 31,  # y = p: a non-canonical spelling of y = 0, small order
    "f0" + "ff" * 30 + "7f", "ff" * 32,  # y = p + 3, 2**255 - 1: other spellings of a point, once more
])
def test_a_peer_id_whose_key_spells_y_at_or_over_p_is_refused(key_hex):
    # OpenSSL accepts these keys; for y = p, the all-zero-S signature with R = the identity
    # verifies for about a quarter of all messages, so anyone could sign as that peer id.
    from groundswell.protocol.identity import (
        IdentityError,
        peer_id_from_public_bytes,
        public_key_from_peer_id,
    )

    with pytest.raises(IdentityError):
        public_key_from_peer_id(peer_id_from_public_bytes(bytes.fromhex(key_hex)))


@pytest.mark.parametrize("tail", [" ", "\n", "\t", " \n"])
def test_a_peer_id_spelled_with_whitespace_is_not_a_second_id_of_its_key(ident, tail):
    # Found by a review of the wire boundary: the base58 decoder strips whitespace, so "id " named
    # the same key as "id" and verified its signatures: one key, several peer records (voters).
    from groundswell.protocol.identity import IdentityError, public_key_from_peer_id, verify

    sig = ident.sign(b"m")
    assert verify(ident.peer_id, b"m", sig)
    with pytest.raises(IdentityError, match="canonically spelled"):
        public_key_from_peer_id(ident.peer_id + tail)
    assert not verify(ident.peer_id + tail, b"m", sig)


def test_an_identity_file_other_users_can_read_is_loaded_with_a_warning(tmp_path, ident, caplog):
    # Found by a review of the state files: a 0644 key loaded silently (ssh says so, and so do we).
    import logging
    import os

    path = tmp_path / "id.key"
    ident.save(path)
    with caplog.at_level(logging.WARNING, logger="groundswell.protocol.identity"):
        assert Identity.load(path).peer_id == ident.peer_id
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="groundswell.protocol.identity"):
        assert Identity.load(path).peer_id == ident.peer_id
    assert any(r.levelno >= logging.WARNING and "chmod 600" in r.getMessage() for r in caplog.records)


def test_a_readable_file_that_is_no_key_is_refused_without_the_chmod_warning(tmp_path, caplog):
    # Found by a review: `--identity README.md` warned "chmod 600 it" before saying it is no key.
    import logging
    import os

    path = tmp_path / "notes.txt"
    path.write_text("not a key\n")
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="groundswell.protocol.identity"):
        with pytest.raises(IdentityError, match="notes.txt"):
            Identity.load(path)
    assert not [r for r in caplog.records if "chmod 600" in r.getMessage()]
