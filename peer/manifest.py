"""The run manifest: one signed TOML document that every peer of a run trains by.

The coordinator writes the TOML, `sign_manifest` turns it into canonical bytes signed with the
coordinator's identity, and volunteers only accept a manifest signed by the coordinator named in
their bootstrap string (`gs1:<coordinator>@<maddr>,...`). Verification rebuilds the manifest with
the same strict loader as the TOML, so a signed but malformed manifest is still rejected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
from groundswell.compression.wire_bounds import count_objects
from groundswell.peer.config import (
    ALGORITHMS,
    ConfigError,
    DataSection,
    EvalSection,
    InnerSection,
    ModelSection,
    OuterSection,
    from_mapping,
    to_mapping,
)
from groundswell.peer.manifest_rules import check_limits, refuse_unused
from groundswell.protocol.identity import (
    SIGNATURE_BYTES,
    Identity,
    IdentityError,
    public_key_from_peer_id,
    verify,
)

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20
MAX_ALLOWLIST = 10_000
MAX_REPLICAS = 3  # a shard goes to the first of its 4 reporting candidates that take it
# round.slack_s bounds requests (a claim, a report): below this, too few are answered in time over
# the internet (0.1 s was allowed: with a 0.25 s deadline a live run retried round 1 113 times)
MIN_SLACK_S = 0.5
MIN_DEADLINE_S = 2.0  # round.deadline_s: below this the trainers' jitter alone outlasts an attempt
MAX_DEADLINE_S = 86400.0  # round.deadline_s: a day; timers far beyond it overflow
# signatures are domain-separated: the same identity also signs round messages
_SIGNING_DOMAIN = b"groundswell/manifest/v1\x00"
_RUN_ID = re.compile(r"[a-z0-9-]{1,48}")
_INT64 = (-(1 << 63), (1 << 63) - 1)


class ManifestError(ValueError):
    """A signed manifest is malformed, badly signed, or signed by the wrong coordinator."""


@dataclass(frozen=True)
class _RunScalars:
    """The [run] keys that the shared loader can type-check (it has no list type)."""

    id: str = ""
    open: bool = False  # true: anyone may contribute; false: only the allowlist
    open_state: bool = True  # closed runs: may peers not on the allowlist download the state?
    min_peers: int = 1
    seed: int = 0


@dataclass(frozen=True)
class RunSection(_RunScalars):
    """Who the run is: its id, who may contribute, and how many peers it needs."""

    allowlist: tuple[str, ...] = ()  # Ed25519 peer ids (12D3KooW...)

    def __post_init__(self) -> None:
        if not _RUN_ID.fullmatch(self.id):
            raise ConfigError(f"run.id must be 1-48 characters of [a-z0-9-], got {self.id!r}")
        if self.min_peers < 1:
            raise ConfigError(f"run.min_peers must be >= 1, got {self.min_peers}")
        if not 0 <= self.seed <= _INT64[1]:
            raise ConfigError(f"run.seed must be in [0, 2**63), got {self.seed}")
        for i, peer_id in enumerate(self.allowlist):
            try:
                public_key_from_peer_id(peer_id)
            except IdentityError as exc:
                raise ConfigError(f"run.allowlist[{i}]: {exc}") from None
        if len(set(self.allowlist)) != len(self.allowlist):
            raise ConfigError("run.allowlist lists a peer id twice")
        if self.open and self.allowlist:
            raise ConfigError("run.open = true and run.allowlist exclude each other; choose one")
        if not self.open and not self.allowlist:
            raise ConfigError("a closed run needs run.allowlist (peer ids); or set run.open = true")


@dataclass(frozen=True)
class RoundSection:
    """Round timing: how long a round may take and how many shards a contribution may have.

    A round is decided by `deadline_s` after the previous one, even when its leader fails: the
    leader closes it one slack earlier and a stand-in takes over a slack later. Contributions
    are taken until a slack before the close, so `deadline_s - 2 * slack_s` is the time to train."""

    deadline_s: float = 30.0
    slack_s: float = 5.0  # the margin for messages in flight, and a stand-in's wait for a silent leader
    max_shards: int = 16
    # Copies of each contribution shard beyond the first, on other aggregators, so that a source
    # that dies before the seal is replaced instead of costing a retried attempt. Unset: 1 for
    # dense codecs (each copy is another full-size upload), 2 for sparseloco (copies are small).
    replicas: int | None = None

    def __post_init__(self) -> None:
        if not self.deadline_s >= MIN_DEADLINE_S:
            raise ConfigError(f"round.deadline_s must be at least {MIN_DEADLINE_S:g} s, got {self.deadline_s}")
        if not self.deadline_s <= MAX_DEADLINE_S:
            raise ConfigError(f"round.deadline_s must be at most {MAX_DEADLINE_S:g} s (a day), got {self.deadline_s}")
        if not self.slack_s >= MIN_SLACK_S:  # it bounds every request: with 0 none could ever be answered
            raise ConfigError(f"round.slack_s must be at least {MIN_SLACK_S:g} s, got {self.slack_s}")
        if not self.deadline_s > 2 * self.slack_s:
            raise ConfigError(f"round.deadline_s ({self.deadline_s}) must exceed 2 x round.slack_s ({self.slack_s}): "
                              "contributions close two slacks before the deadline")
        if self.max_shards < 1:
            raise ConfigError(f"round.max_shards must be >= 1, got {self.max_shards}")
        if self.replicas is not None and not 0 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"round.replicas must be 0..{MAX_REPLICAS}, got {self.replicas}")


@dataclass(frozen=True)
class DefencesSection:
    """How peers protect the run from broken and hostile peers (see protocol/README.md)."""

    clip: float = 1.0  # clip each contribution's norm, per shard, to clip * the round's median norm; 0 = off
    trim: float = 0.0  # dense codecs: coordinate-wise trimmed mean, this fraction cut at each end
    requests_per_s: float = 50.0  # per remote peer; bursts of 2 s worth pass
    max_streams: int = 32  # concurrent inbound streams per remote peer
    strikes: int = 20  # violations within ban_s that get a peer banned...
    ban_s: float = 60.0  # ...for this long
    max_clock_skew_s: float = 120.0  # messages stamped further from the receiver's clock are dropped
    verify_aggregates: bool = False  # dense codecs: aggregates carry every signed contribution, not the mean
    scoring: bool = False  # the leader tries each contribution alone on a probe batch...
    score_threshold: float = 0.0  # ...and drops those that raise the probe loss by more than this
    score_batches: int = 2  # probe batches (of data.batch_size windows)

    def __post_init__(self) -> None:
        checks = (("clip", self.clip >= 0, "must be >= 0"), ("trim", 0 <= self.trim < 0.5, "must be in [0, 0.5)"),
                  ("requests_per_s", self.requests_per_s > 0, "must be positive"),
                  ("max_streams", self.max_streams >= 1, "must be >= 1"), ("strikes", self.strikes >= 1, "must be >= 1"),
                  ("ban_s", self.ban_s >= 0, "must be >= 0"),
                  ("max_clock_skew_s", self.max_clock_skew_s > 0, "must be positive"),
                  ("score_batches", self.score_batches >= 1, "must be >= 1"),
                  ("score_threshold", self.score_threshold == self.score_threshold, "must be a number"))
        _first_failed("defences", self, checks)


@dataclass(frozen=True)
class CheckpointSection:
    """How often the coordinator checkpoints the global model, and how many it keeps."""

    every_rounds: int = 10
    keep: int = 3

    def __post_init__(self) -> None:
        _first_failed("checkpoint", self, (("every_rounds", self.every_rounds >= 1, "must be >= 1"),
                                           ("keep", self.keep >= 1, "must be >= 1")))


def _first_failed(section: str, values: object, checks: tuple[tuple[str, bool, str], ...]) -> None:
    """Refuse the first key whose check failed, naming that key alone and its value."""
    for name, ok, rule in checks:
        if not ok:
            raise ConfigError(f"{section}.{name} {rule}, got {getattr(values, name)!r}")


SWARM_ALGORITHMS = ("diloco", "sparseloco")  # the outer algorithms a run can use


@dataclass(frozen=True)
class RunManifest:
    """Everything a peer needs to join a run, apart from where to find other peers."""

    run: RunSection
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    inner: InnerSection = field(default_factory=InnerSection)
    outer: OuterSection = field(default_factory=OuterSection)
    round: RoundSection = field(default_factory=RoundSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    defences: DefencesSection = field(default_factory=DefencesSection)

    def __post_init__(self) -> None:
        if self.outer.algorithm not in SWARM_ALGORITHMS:
            # single trains alone; data-parallel all-reduces every step (train-local's baselines)
            raise ConfigError(f"outer.algorithm {self.outer.algorithm!r} cannot run in a swarm: "
                              f"use {' or '.join(SWARM_ALGORITHMS)}")
        if self.defences.trim and self.outer.codec_name == "sparseloco":
            raise ConfigError("defences.trim is for dense codecs: a sparse update's trimmed mean is mostly zeros")
        if self.defences.trim and self.outer.algorithm == "sparseloco":
            # its cuts are per coordinate, and no peer learns them: the error feedback would lose them
            raise ConfigError("defences.trim cannot go with outer.algorithm = 'sparseloco': what a trimmed mean "
                              "cuts off would be lost from the error feedback (use defences.clip)")
        if self.defences.scoring and self.outer.codec_name != "sparseloco" and not self.defences.verify_aggregates:
            # a dense codec's aggregator ships only the mean: nobody else holds a single contribution
            raise ConfigError(f"defences.scoring with the {self.outer.codec_name!r} codec needs "
                              "defences.verify_aggregates = true (or the sparseloco codec)")
        check_limits(self)  # (across sections: see manifest_rules)
        # the manifest is signed as msgpack: numbers must be representable and unambiguous
        _check_numbers(to_mapping(self), "")

    def to_mapping(self) -> dict[str, Any]:
        """Plain nested dicts (lists for the allowlist), as loaded from TOML."""
        return to_mapping(self)

    def check_may_train(self, peer_id: str) -> None:
        """ConfigError, naming the id to send the coordinator, unless `peer_id` may contribute."""
        if not self.run.open and peer_id not in self.run.allowlist:
            raise ConfigError(f"run {self.run.id} is closed and this peer is not on its allowlist, which is fixed "
                              f"at launch: send {peer_id} to its coordinator for the next run, or join with an "
                              "--identity the run lists")

    def canonical_bytes(self) -> bytes:
        """Deterministic msgpack of the manifest: keys sorted at every level."""
        mapping = to_mapping(self)
        if not mapping["model"]["layout"]:  # (as versions before it signed them: those still verify)
            del mapping["model"]["layout"]
        return msgpack.packb(_sorted(mapping), use_bin_type=True)


def _check_numbers(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(item, f"{where}.{key}" if where else key)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_numbers(item, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value}")
    elif isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
        raise ConfigError(f"{where} is out of the 64-bit integer range: {value}")


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_sorted(item) for item in value]
    return value


def manifest_from_mapping(data: Mapping[str, Any]) -> RunManifest:
    """Build a RunManifest strictly from nested dicts (parsed TOML or a verified signed manifest)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"the manifest must be a table, got {type(data).__name__}")
    _check_keys(data, "")  # msgpack may also produce bytes keys, which the shared loader can't sort
    known = {f.name for f in dataclasses.fields(RunManifest)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}; known sections: {', '.join(sorted(known))}")
    if "run" not in data:
        raise ConfigError("the manifest needs a [run] section")
    outer = data.get("outer")
    if isinstance(outer, Mapping) and outer.get("algorithm", "sparseloco") not in (*SWARM_ALGORITHMS, *ALGORITHMS):
        # before the shared [outer] check, which would list train-local's baselines as choices too
        raise ConfigError(f"outer.algorithm must be {' or '.join(SWARM_ALGORITHMS)} in a run, got {outer['algorithm']!r}")
    hints = typing.get_type_hints(RunManifest)
    sections: dict[str, Any] = {"run": _run_from_mapping(data["run"])}
    for name, value in data.items():
        if name != "run":
            sections[name] = from_mapping(hints[name], value, name)
    return RunManifest(**sections)


def _check_keys(value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where or 'the manifest'} has a non-string key {key!r}")
            _check_keys(item, f"{where}.{key}" if where else key)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_keys(item, f"{where}[{i}]")


def _run_from_mapping(data: Any) -> RunSection:
    if not isinstance(data, Mapping):
        raise ConfigError(f"run must be a table, got {type(data).__name__}")
    known = [f.name for f in dataclasses.fields(RunSection)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown key 'run.{unknown[0]}'; known keys: {', '.join(known)}")
    scalars = dict(data)
    allowlist = scalars.pop("allowlist", [])
    if not isinstance(allowlist, (list, tuple)) or len(allowlist) > MAX_ALLOWLIST:
        raise ConfigError(f"run.allowlist must be a list of at most {MAX_ALLOWLIST} peer ids")
    typed = from_mapping(_RunScalars, scalars, "run")
    return RunSection(**dataclasses.asdict(typed), allowlist=tuple(allowlist))


def load_manifest_toml(path: str | os.PathLike[str]) -> RunManifest:
    """Load and validate a run manifest TOML file; ConfigError names the bad key."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {os.fspath(path)}: {exc.strerror}") from None
    if len(text) > MAX_MANIFEST_BYTES:
        raise ConfigError(f"{os.fspath(path)} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # (TOMLDecodeError, UnicodeDecodeError; an int of 5,000
        # digits is a plain ValueError, arrays nested 3,000 deep a RecursionError: a review)
        raise ConfigError(f"{os.fspath(path)}: invalid TOML: {str(exc)[:300] or type(exc).__name__}") from None
    try:
        manifest = manifest_from_mapping(data)
        refuse_unused(data, manifest)
    except ConfigError as exc:
        raise ConfigError(f"{os.fspath(path)}: {exc}") from None
    return manifest


@dataclass(frozen=True)
class SignedManifest:
    """A manifest's canonical bytes, the coordinator's peer id, and its Ed25519 signature."""

    manifest_bytes: bytes
    coordinator: str
    signature: bytes

    @property
    def signed_bytes(self) -> bytes:
        """Exactly what the coordinator signs: domain tag, coordinator id, manifest bytes."""
        return _SIGNING_DOMAIN + self.coordinator.encode() + b"\x00" + self.manifest_bytes

    @property
    def digest(self) -> str:
        """sha256 hex of the signed bytes: names this manifest and its coordinator."""
        return hashlib.sha256(self.signed_bytes).hexdigest()

    def to_bytes(self) -> bytes:
        """The wire form (msgpack)."""
        return msgpack.packb(
            [MANIFEST_VERSION, self.coordinator, self.manifest_bytes, self.signature], use_bin_type=True
        )

    @classmethod
    def from_bytes(cls, data: bytes, max_bytes: int = MAX_MANIFEST_BYTES) -> SignedManifest:
        """Parse the wire form strictly (does not check the signature; `verify` does)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ManifestError(f"a signed manifest is bytes, got {type(data).__name__}")
        if len(data) > max_bytes:
            raise ManifestError(f"signed manifest is {len(data)} bytes; the limit is {max_bytes}")
        try:
            count_objects(bytes(data), 8)  # an array of 4 scalars: nothing nested is built
            obj = msgpack.unpackb(bytes(data), raw=False, use_list=True, strict_map_key=True)
        except MemoryError:
            raise
        except ValueError as exc:
            raise ManifestError(f"signed manifest is not valid msgpack: {exc}") from None
        except Exception as exc:
            raise ManifestError(f"signed manifest is not valid msgpack: {type(exc).__name__}") from None
        if not isinstance(obj, list) or len(obj) != 4:
            raise ManifestError("signed manifest must be a 4-element array")
        version, coordinator, manifest_bytes, signature = obj
        if type(version) is not int or version != MANIFEST_VERSION:
            raise ManifestError(
                f"unsupported signed manifest version {version!r}; expected {MANIFEST_VERSION}"
            )
        if not isinstance(coordinator, str):
            raise ManifestError("signed manifest coordinator must be a peer id string")
        try:
            public_key_from_peer_id(coordinator)
        except IdentityError as exc:
            raise ManifestError(f"signed manifest coordinator: {exc}") from None
        if not isinstance(manifest_bytes, bytes) or not manifest_bytes:
            raise ManifestError("signed manifest body must be non-empty bytes")
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise ManifestError(f"signed manifest signature must be {SIGNATURE_BYTES} bytes")
        return cls(manifest_bytes, coordinator, signature)

    def verify(self, expected_coordinator: str) -> RunManifest:
        """Check signer and signature, then rebuild the manifest strictly; ManifestError if any fails."""
        if self.coordinator != expected_coordinator:
            raise ManifestError(
                f"manifest is signed by {self.coordinator}, not by the expected coordinator {expected_coordinator}"
            )
        if not verify(self.coordinator, self.signed_bytes, self.signature):
            raise ManifestError("manifest signature does not verify")
        try:
            data = msgpack.unpackb(self.manifest_bytes, raw=False, use_list=True, strict_map_key=True)
        except Exception as exc:
            raise ManifestError(f"signed manifest body is not valid msgpack: {type(exc).__name__}") from None
        try:
            manifest = manifest_from_mapping(data)
        except ConfigError as exc:
            raise ManifestError(f"signed manifest is invalid: {exc}") from None
        # one manifest, one byte string: otherwise equal runs could have different digests
        if manifest.canonical_bytes() != self.manifest_bytes:
            raise ManifestError("signed manifest is not in canonical form")
        return manifest


def sign_manifest(manifest: RunManifest, identity: Identity) -> SignedManifest:
    """Sign `manifest` as its coordinator."""
    unsigned = SignedManifest(manifest.canonical_bytes(), identity.peer_id, b"")
    return dataclasses.replace(unsigned, signature=identity.sign(unsigned.signed_bytes))


# ---- bootstrap strings -------------------------------------------------------------------------
