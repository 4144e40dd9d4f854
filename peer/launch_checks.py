"""What `launch` checks and records of its run before it serves it: the manifest's model and
dataset are here (the dataset's fingerprint and the model's parameter layout signed into the
manifest, for volunteers' copies to match), and the state dir holds this run or none (same manifest and key as when it was first
launched, recorded once the network is up)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ConfigError
from .state_files import write_atomically

if TYPE_CHECKING:
    from .data import Corpus
    from .manifest import RunManifest
    from .workload import Workload

log = logging.getLogger(__name__)


def prepare_manifest(manifest: RunManifest, path: Path) -> tuple[RunManifest, Corpus, Workload]:
    """The manifest's model and corpus must exist here before anything is written: one error line
    naming the file and the key. Returns the manifest with its corpus's fingerprint and its
    model's parameter layout (which volunteers' copies must match), the corpus and the workload,
    each built once."""
    import dataclasses

    from .data import DataError, load_corpus
    from .workload import WorkloadError, build_workload, check_workload_spec, parameter_layout

    try:
        check_workload_spec(manifest.model.spec)
    except WorkloadError as exc:
        raise ConfigError(f"{path}: model.spec: {exc}") from None
    try:
        corpus = load_corpus(manifest.data.source)  # says what it expects
    except DataError as exc:
        raise ConfigError(f"{path}: data.source: {exc}") from None
    given = manifest.data.fingerprint
    if given and given != corpus.fingerprint:
        raise ConfigError(f"{path}: data.fingerprint is {given}, but {manifest.data.source} here has "
                          f"{corpus.fingerprint}: its files or sizes changed (leave the key out to take them)")
    try:  # (as the coordinator's Participant builds it: it is handed this one)
        workload = build_workload(manifest.model.spec, corpus.vocab_size, manifest.run.seed)
    except WorkloadError as exc:
        raise ConfigError(f"{path}: model.spec: {exc}") from None
    layout = parameter_layout(workload.model)
    if manifest.model.layout and manifest.model.layout != layout:
        raise ConfigError(f"{path}: model.layout is {manifest.model.layout}, but {manifest.model.spec} here builds "
                          f"{layout}: its parameters' names, shapes or order changed (leave the key out to take them)")
    manifest = dataclasses.replace(manifest, model=dataclasses.replace(manifest.model, layout=layout))
    if manifest.data.source == "stdlib":  # differs with every Python build: a patch upgrade would
        return manifest, corpus, workload  # refuse the run's own resume; volunteers' may differ anyway
    data = dataclasses.replace(manifest.data, fingerprint=corpus.fingerprint)
    return dataclasses.replace(manifest, data=data), corpus, workload


def as_first_launched(state_dir: Path, manifest: RunManifest) -> RunManifest:
    """`manifest` without its model.layout where the state dir's run was launched by a version that
    signed none and nothing else differs: resumed as it ran (volunteers hold that manifest, and a
    new one would be refused as another run's), the volunteers' builds unchecked."""
    import dataclasses

    from .manifest import ManifestError, SignedManifest

    try:
        first = SignedManifest.from_bytes((state_dir / "manifest.signed").read_bytes())
        old = first.verify(first.coordinator)
    except (OSError, ManifestError):  # none, or not one: `same_run_as_before` says so
        return manifest
    unchecked = dataclasses.replace(manifest, model=dataclasses.replace(manifest.model, layout=""))
    if old.model.layout or not manifest.model.layout or old != unchecked:
        return manifest
    log.warning("this run was launched by a groundswell version that signed no model.layout: volunteers' "
                "builds of the model are not checked against the coordinator's")
    return unchecked


def same_run_as_before(state_dir: Path, signed: bytes) -> None:
    """Refuse a state dir launched before with another manifest or coordinator key (`record_run`
    records one once its network is up). Volunteers keep the manifest they verified when they
    joined: a coordinator back with other settings (deadline, learning rate, allowlist) under the
    same run id would split the swarm, and one back under another key is a stranger to them."""
    from .manifest import ManifestError, SignedManifest

    path, new = state_dir / "manifest.signed", SignedManifest.from_bytes(signed)
    if path.exists():
        try:
            old = SignedManifest.from_bytes(path.read_bytes())
        except ManifestError as exc:
            raise ConfigError(f"{path} is not a signed manifest ({exc}); move it away to launch here") from None
        if old.digest != new.digest:
            what = "coordinator key (--identity)" if old.manifest_bytes == new.manifest_bytes else "manifest"
            if _differs_only_in(old, new, "data", "fingerprint"):
                what = "copy of its dataset (data.source's files or sizes changed since; volunteers train on the first)"
            elif _differs_only_in(old, new, "model", "layout"):
                what = ("model (model.spec now builds parameters of other names, shapes or order; volunteers hold the "
                        "first)" if old.verify(old.coordinator).model.layout else
                        "groundswell version (one that signed no model.layout)")
            raise ConfigError(f"{state_dir} holds a run launched with another {what}: resume it with the same "
                              "manifest and --identity, or start a new run (a new run.id and --state-dir)")


def _differs_only_in(old, new, section: str, key: str) -> bool:
    """Do two signed manifests differ only in `section.key`?"""
    import dataclasses

    from .manifest import ManifestError

    try:
        a, b = old.verify(old.coordinator), new.verify(new.coordinator)
    except ManifestError:  # an older version's manifest: not comparable key by key
        return False

    def blank(m):
        return dataclasses.replace(m, **{section: dataclasses.replace(getattr(m, section), **{key: ""})})

    return getattr(getattr(a, section), key) != getattr(getattr(b, section), key) and blank(a) == blank(b)


def record_run(state_dir: Path, signed: bytes) -> None:
    """Bind the state dir to this signed manifest: only once the network is up, since no peer can
    have seen a run whose network never started (recorded then, a typo in --listen would have
    bound the state dir to a manifest the user still meant to correct)."""
    write_atomically(state_dir / "manifest.signed", lambda f: f.write(signed))


def not_a_volunteer_dir(state_dir: Path) -> None:
    """Refuse a volunteer's state dir: its identity would become the coordinator's key, and the
    coordinator's exit checkpoint would replace the volunteer's of the same round (which holds its
    unsent work) with one that holds none."""
    from .volunteer_dir import VOLUNTEER_FILE

    if (state_dir / VOLUNTEER_FILE).exists():
        raise ConfigError(f"{state_dir} is a volunteer's state dir ({VOLUNTEER_FILE}): launch with another --state-dir")


def resumable(state_dir: Path, found: object) -> None:
    """Refuse a state dir whose checkpoints are all unreadable (`found`: what the newest readable
    one held, None if none): a new genesis would sign a round 0 of another state under the run's
    volunteers, all past it."""
    from .state_files import checkpoints_newest_first

    if found is None and checkpoints_newest_first(state_dir):
        raise ConfigError(f"none of the checkpoints in {state_dir} can be read (see the log lines above): "
                          "copy in a good one (a volunteer's --state-dir of this run holds some), or start a "
                          "new run (a new run.id and --state-dir)")


GENESIS_MARK = "genesis.done"  # written once the run's first checkpoint is: from then on a state dir holds some


def mark_genesis_saved(state_dir: Path) -> None:
    """Note that this state dir has held a checkpoint of its run (see `checkpoints_not_gone`)."""
    if (state_dir / GENESIS_MARK).exists():
        return
    try:
        write_atomically(state_dir / GENESIS_MARK, lambda f: f.write(b"the run's first checkpoint was written here\n"))
    except OSError as exc:  # the checkpoints are what matter: the run goes on, unguarded against their loss
        log.warning("could not write %s in %s (%s): a launch here after its checkpoints are lost would not "
                    "be refused", GENESIS_MARK, state_dir, exc)


def checkpoints_not_gone(state_dir: Path) -> None:
    """Refuse a state dir that has held a checkpoint of its run (`mark_genesis_saved`) but holds none
    now: a launch would sign a new genesis, a round 0 of another state, under the run's volunteers,
    all past it. (A launch stopped before its first checkpoint leaves no mark: nobody holds a state.)"""
    from .state_files import checkpoints_newest_first

    if (state_dir / GENESIS_MARK).exists() and not checkpoints_newest_first(state_dir):
        raise ConfigError(f"{state_dir} held checkpoints of this run ({GENESIS_MARK}) but holds none now: copy in "
                          "a good one (a volunteer's --state-dir of this run holds some), or start a new run (a "
                          "new run.id and --state-dir)")
