"""Training data: corpora, disjoint per-worker shards, and a fixed held-out set.

Three corpus sources, all offline:

* ``"stdlib"``: the ``.py`` files of the running Python's standard library (about
  30 MB), as bytes (vocab 256). Real text that every machine already has.
* a folder (or single file) of text: every non-hidden file under it, as bytes.
* a nanoGPT-style folder with ``train.bin`` / ``val.bin`` of uint16 tokens
  (memory-mapped; optional ``meta.json`` with ``{"vocab_size": N}``; without it the
  largest token sets the vocab, remembered in a small hidden file next to train.bin;
  see ``bin_corpus.py``).

Text corpora are split into train / held-out by a hash of each file's relative path,
when there are at least 10 files and those held out hold about 5% of the bytes (between
1% and 10%). Otherwise (a single file, a few files, or a file that dominates) the last 5%
of every file is held out instead. Either way the split depends only on the files' names
and sizes, never on the machine or the run seed. Files (or their parts) are joined in
sorted-path order with a 0 byte between them.

Batches of a corpus (the train stream's windows, the held-out set) are in ``batches.py``.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch
from torch import Tensor

# Either a 1-D torch tensor (text corpora, uint8) or a 1-D np.memmap (.bin corpora, uint16).
TokenArray = Union[Tensor, np.ndarray]
Batch = tuple[Tensor, Tensor]

HELDOUT_FRACTION = 0.05
# The share of the bytes whole held-out files may hold; outside it the split falls back to tails,
# or one big file landing under the hash would be most of the corpus (or a tiny one, all of eval).
# 1%: a corpus of up to 100 similar files whose one held-out file is the lowest hash still splits whole.
HELDOUT_BYTES_RANGE = (0.01, 0.10)
# Fewer files split whole hinge on one file (a README held out from a single big text, say).
MIN_FILES_FOR_WHOLE_SPLIT = 10
FILE_SEPARATOR = 0  # never occurs in source code, so it marks document boundaries cleanly
_EXCLUDED_STDLIB_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """A corpus could not be loaded or is unusable (missing, empty, unreadable, too small)."""


@dataclass
class Corpus:
    """Token streams for training and held-out evaluation, plus identity metadata."""

    name: str
    train: TokenArray
    heldout: TokenArray
    vocab_size: int
    fingerprint: str  # short hex of the files and their sizes; a volunteer's must match the manifest's
    train_files: tuple[str, ...] = ()  # relative paths (text corpora only)
    heldout_files: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Total tokens across the train and held-out streams."""
        return len(self.train) + len(self.heldout)


def load_corpus(source: str) -> Corpus:
    """Load ``"stdlib"``, a text file/folder, or a folder with train.bin/val.bin."""
    if source == "stdlib":
        return _load_stdlib()
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"corpus path {str(path)!r} does not exist (expected 'stdlib', a folder or a file)")
    if path.is_dir() and _holds_bin_corpus(path):
        from .bin_corpus import load_bin_folder  # (it builds on this module's Corpus)

        return load_bin_folder(path)  # says which of the two is missing
    if path.is_file() and (path.suffix == ".bin" or _holds_bin_corpus(path.parent)):
        # read as text it would train on the raw bytes of the token arrays (vocab 256), silently
        raise DataError(
            f"{str(path)!r} is part of a train.bin/val.bin corpus: give the folder that holds train.bin and val.bin"
        )
    return _load_text(path, name=path.resolve().name, skip_dir=lambda name: name.startswith("."))


def _holds_bin_corpus(folder: Path) -> bool:
    return (folder / "train.bin").exists() or (folder / "val.bin").exists()


# --- text corpora -------------------------------------------------------------------------------


def _load_stdlib() -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    return _load_text(root, name="stdlib", skip_dir=lambda name: name in _EXCLUDED_STDLIB_DIRS, suffix=".py")


def _list_files(root: Path, skip_dir: Callable[[str], bool], suffix: str | None) -> list[str]:
    """Sorted relative POSIX paths of the files under root (hidden files skipped)."""
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d) and not d.startswith(".")]
        for filename in filenames:
            if filename.startswith(".") or (suffix is not None and not filename.endswith(suffix)):
                continue
            relpath = Path(dirpath, filename).relative_to(root).as_posix()
            try:  # names go into the fingerprint and the split as UTF-8, the same on every machine
                relpath.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(f"the file name {os.fsencode(relpath)!r} under {str(root)!r} is not UTF-8: rename "
                                "it, or move it out of the corpus") from None
            if suffix is None and filename in ("train.bin", "val.bin"):
                # read as text, the token arrays would be trained on as bytes (vocab 256), val.bin
                # among the training files (and an 18 GB train.bin read whole into memory)
                raise DataError(f"{str(root)!r} holds a train.bin/val.bin corpus in {str(Path(dirpath))!r}: give "
                                "that folder")
            relpaths.append(relpath)
    return sorted(relpaths)


def _path_hash(relpath: str) -> float:
    """Uniform value in [0, 1) derived from a relative path, the same on every machine."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _file_sizes(root: Path, relpaths: list[str]) -> dict[str, int]:
    sizes = {}
    for relpath in relpaths:
        try:
            sizes[relpath] = (root / relpath).stat().st_size
        except OSError as exc:
            raise DataError(f"cannot read corpus file {str(root / relpath)!r}: {exc}") from exc
    return sizes


# A file whose name says it is held out: `valid.txt`, `wiki.test.raw`, `dev-00.txt`.
MIN_NAMED_HELDOUT_BYTES = 16 << 10
_HELDOUT_WORDS = frozenset({"valid", "validation", "val", "test", "dev", "heldout"})


def _named_split(relpaths: list[str], sizes: dict[str, int]) -> tuple[list[str], list[str]] | None:
    """Train and held-out files by their names, in a folder of a few (wikitext's `wiki.train.raw`,
    `wiki.valid.raw`, `wiki.test.raw`): holding out the tail of each, the folder's own validation
    and test files were 95% trained on (a review, 2026-12-07). None when the names do not say."""
    if len(relpaths) >= MIN_FILES_FOR_WHOLE_SPLIT:
        return None  # (a large folder is split by path hash: a `test_x.py` among thousands is no test set)
    named = [p for p in relpaths if _HELDOUT_WORDS & set(re.split(r"[^a-z]+", Path(p).name.lower()))]
    if not named or len(named) == len(relpaths):
        return None
    # enough text to evaluate on, and no more than is left to train on (an empty test.txt, a
    # dev-notes.txt of a few lines, a test file larger than the code: tails of every file, as before)
    held, total = sum(sizes[p] for p in named), sum(sizes.values())
    if held < MIN_NAMED_HELDOUT_BYTES or held > total / 2:
        return None
    return [p for p in relpaths if p not in named], named


def _split_files(relpaths: list[str], sizes: dict[str, int]) -> tuple[list[str], list[str]] | None:
    """Train and held-out files by path hash, or None when whole files cannot hold out about
    HELDOUT_FRACTION of the bytes (the caller then holds out the tail of every file)."""
    if len(relpaths) < MIN_FILES_FOR_WHOLE_SPLIT:
        return None
    heldout = [p for p in relpaths if _path_hash(p) < HELDOUT_FRACTION]
    if not heldout or len(heldout) == len(relpaths):
        # The hash threshold left one side empty. Hold out exactly the file with the
        # smallest hash, which is still a function of the names alone.
        heldout = [min(relpaths, key=_path_hash)]
    held = set(heldout)
    total = sum(sizes.values())
    fraction = sum(sizes[p] for p in heldout) / total if total else 0.0
    low, high = HELDOUT_BYTES_RANGE
    if not low <= fraction <= high:
        return None
    return [p for p in relpaths if p not in held], heldout


def _tail_sizes(relpaths: list[str], sizes: dict[str, int]) -> list[int]:
    """Bytes held out at the end of each file: HELDOUT_FRACTION of each (at least one byte in all)."""
    tails = [int(sizes[p] * HELDOUT_FRACTION) for p in relpaths]
    if not any(tails):  # all files tiny: one byte of the largest, as a single file always had
        largest = max(range(len(relpaths)), key=lambda i: sizes[relpaths[i]])
        tails[largest] = min(1, sizes[relpaths[largest]])
    return tails


def _read_into(path: Path, start: int, view: memoryview) -> None:
    """Fill `view` with the bytes of `path` from offset `start`."""
    got = 0
    try:
        with path.open("rb", buffering=0) as f:  # unbuffered: straight into the corpus buffer
            f.seek(start)
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
    except OSError as exc:
        raise DataError(f"cannot read corpus file {str(path)!r}: {exc}") from exc
    if got < len(view):
        raise DataError(f"corpus file {str(path)!r} shrank while it was read; load the corpus again")


def _join_pieces(root: Path, pieces: list[tuple[str, int, int]]) -> Tensor:
    """Byte ranges (relpath, start, length) of files, joined with FILE_SEPARATOR, as one uint8 tensor."""
    # One buffer of the final size, read into in place: the corpus is held once, not three times.
    # bytearray (writable) lets torch share it without a copy or a warning.
    buffer = bytearray(sum(n for _, _, n in pieces) + max(0, len(pieces) - 1))
    view, pos = memoryview(buffer), 0
    for i, (relpath, start, length) in enumerate(pieces):
        if i:
            buffer[pos] = FILE_SEPARATOR
            pos += 1
        _read_into(root / relpath, start, view[pos : pos + length])
        pos += length
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _fingerprint(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()[:16]


def _load_text(
    path: Path, name: str, skip_dir: Callable[[str], bool], suffix: str | None = None
) -> Corpus:
    if path.is_file():
        root, relpaths = path.parent, [path.name]
    else:
        root, relpaths = path, _list_files(path, skip_dir, suffix)
    if not relpaths:
        raise DataError(f"corpus {str(path)!r} contains no files")
    sizes = _file_sizes(root, relpaths)
    total = sum(sizes.values())
    if total == 0:
        raise DataError(f"corpus {str(path)!r} is empty (all {len(relpaths)} files have size 0)")

    named = _named_split(relpaths, sizes)
    split = named or _split_files(relpaths, sizes)
    if split is not None:
        train_files, heldout_files = split
        train_pieces = [(p, 0, sizes[p]) for p in train_files]
        heldout_pieces = [(p, 0, sizes[p]) for p in heldout_files]
    else:
        # One file, or files that cannot be split whole: hold out the tail of each instead,
        # so evaluation still sees unseen text from every file.
        train_files, heldout_files = relpaths, []
        tails = _tail_sizes(relpaths, sizes)
        train_pieces = [(p, 0, sizes[p] - t) for p, t in zip(relpaths, tails)]
        heldout_pieces = [(p, sizes[p] - t, t) for p, t in zip(relpaths, tails) if t]
    train_bytes = sum(n for _, _, n in train_pieces)
    heldout_bytes = sum(n for _, _, n in heldout_pieces)
    if not 0 < heldout_bytes <= train_bytes:
        raise DataError(
            f"corpus {str(path)!r} has {total} bytes: too little to split into train and held-out text"
        )
    train, heldout = _join_pieces(root, train_pieces), _join_pieces(root, heldout_pieces)

    # Tails of several files: a split older versions did not make, so resumed state from those
    # is refused; a single file and a whole-file split keep their fingerprints.
    # (and files held out by their names: a split that, until 2026-12-07, was tails of each)
    split_part = ["split=tails"] if split is None and len(relpaths) > 1 else ["split=named"] if named else []
    fingerprint = _fingerprint(["text", "vocab=256", *split_part] + [f"{p}\t{sizes[p]}" for p in relpaths])
    return Corpus(
        name=name,
        train=train,
        heldout=heldout,
        vocab_size=256,
        fingerprint=fingerprint,
        train_files=tuple(train_files),
        heldout_files=tuple(heldout_files),
    )
