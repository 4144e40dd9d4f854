"""What `join` takes from a coordinator's signed manifest, and what it asks the volunteer for
instead: a signature vouches for the run, not for paths on the volunteer's disk or code to import."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ConfigError

if TYPE_CHECKING:
    from .data import Corpus
    from .manifest import RunManifest

log = logging.getLogger(__name__)


def volunteer_corpus(manifest: RunManifest, data: Path | None, allow_model_code: bool) -> Corpus:
    """The corpus a volunteer trains on, and its consent to what the coordinator's manifest asks
    of its machine: a coordinator's signature vouches for the run, not for paths on our disk (it
    could name a folder of private files to train on, and its gradients would carry them out) or
    for code to import. So the dataset is the one `--data` names, and a `module:callable` model
    needs `--allow-model-code`; ConfigError, before anything is downloaded, otherwise."""
    from .data import DataError, load_corpus

    if ":" in manifest.model.spec and not allow_model_code:
        raise ConfigError(f"this run's model is {manifest.model.spec!r}, code it would import and run here: "
                          "join with --allow-model-code if you trust it (the module must be installed here)")
    if ":" in manifest.model.spec:
        from .workload import WorkloadError, check_workload_spec

        try:  # before "joined" is said and anything is downloaded (a review saw it refused only after)
            check_workload_spec(manifest.model.spec)
        except WorkloadError as exc:
            raise ConfigError(f"this run's model: {exc}") from None
    source, want = manifest.data.source, manifest.data.fingerprint
    if source == "stdlib":
        if data is not None:
            raise ConfigError("this run trains on the Python standard library's sources: leave --data out")
        corpus = load_corpus("stdlib")
        if want and corpus.fingerprint != want:  # another Python's: other files, but still its sources
            log.warning("this Python's standard library is not the coordinator's (its files differ): this peer "
                        "trains on other files, and the held-out losses it publishes are not comparable")
        return corpus
    if data is None:
        raise ConfigError(f"this run trains on its own dataset ({source!r} on the coordinator's machine): get a "
                          "copy from the coordinator and pass its folder with --data")
    try:
        corpus = load_corpus(str(data))
    except DataError as exc:
        raise ConfigError(f"--data {data}: {exc}") from None
    if want and corpus.fingerprint != want:
        raise ConfigError(f"--data {data} is not the run's dataset: its files or sizes differ from the "
                          f"coordinator's copy (fingerprint {corpus.fingerprint}, the run's {want}); a partial, "
                          "newer or other copy would train this peer on other data")
    return corpus
