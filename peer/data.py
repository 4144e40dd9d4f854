"""Training data: corpora, disjoint per-worker shards, and a fixed held-out set.

Three corpus sources, all offline:

* ``"stdlib"``: the ``.py`` files of the running Python's standard library (about
  30 MB), as bytes (vocab 256). Real text that every machine already has.
* a folder (or single file) of text: every non-hidden file under it, as bytes.
* a nanoGPT-style folder with ``train.bin`` / ``val.bin`` of uint16 tokens
  (memory-mapped; optional ``meta.json`` with ``{"vocab_size": N}``).

Text corpora are split into train / held-out by a hash of each file's relative path,
so the split depends only on names, never on the machine or the run seed. Files are
joined in sorted-path order with a 0 byte between them.

The train stream is cut into non-overlapping windows of ``block_size + 1`` tokens. A
permutation seeded by the run seed deals the windows to shards like cards, so the
shards are disjoint, cover the stream, and are the same on every worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor, nn

# Either a 1-D torch tensor (text corpora, uint8) or a 1-D np.memmap (.bin corpora, uint16).
TokenArray = Union[Tensor, np.ndarray]
Batch = tuple[Tensor, Tensor]

HELDOUT_FRACTION = 0.05
FILE_SEPARATOR = 0  # never occurs in source code, so it marks document boundaries cleanly
HELDOUT_SEED = 0x5EED  # fixed so every worker and every run evaluates on the same batches
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
    fingerprint: str  # short hex; peers compare it to check they train on the same data
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
    if path.is_dir() and (path / "train.bin").exists():
        return _load_bin_folder(path)
    return _load_text(path, name=path.resolve().name, skip_dir=lambda name: name.startswith("."))


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
            relpaths.append(Path(dirpath, filename).relative_to(root).as_posix())
    return sorted(relpaths)


def _path_hash(relpath: str) -> float:
    """Uniform value in [0, 1) derived from a relative path, the same on every machine."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _split_files(relpaths: list[str]) -> tuple[list[str], list[str]]:
    if len(relpaths) == 1:
        return relpaths, []  # the caller holds out the tail of the single file instead
    heldout = [p for p in relpaths if _path_hash(p) < HELDOUT_FRACTION]
    train = [p for p in relpaths if _path_hash(p) >= HELDOUT_FRACTION]
    if not heldout or not train:
        # Few files: the hash threshold may leave one side empty. Hold out exactly the
        # file with the smallest hash, which is still a function of the names alone.
        lowest = min(relpaths, key=_path_hash)
        heldout, train = [lowest], [p for p in relpaths if p != lowest]
    return train, heldout


def _read_files(root: Path, relpaths: list[str]) -> list[bytes]:
    contents = []
    for relpath in relpaths:
        try:
            contents.append((root / relpath).read_bytes())
        except OSError as exc:
            raise DataError(f"cannot read corpus file {str(root / relpath)!r}: {exc}") from exc
    return contents


def _join_bytes(contents: list[bytes]) -> Tensor:
    # bytearray (writable) lets torch share the buffer without a copy or a warning.
    joined = bytearray(bytes([FILE_SEPARATOR]).join(contents))
    if not joined:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(joined, dtype=torch.uint8)


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
    train_files, heldout_files = _split_files(relpaths)
    train_bytes = _read_files(root, train_files)
    heldout_bytes = _read_files(root, heldout_files)
    sizes = dict(zip(train_files + heldout_files, [len(b) for b in train_bytes + heldout_bytes]))
    if sum(sizes.values()) == 0:
        raise DataError(f"corpus {str(path)!r} is empty (all {len(relpaths)} files have size 0)")

    if heldout_files:
        train, heldout = _join_bytes(train_bytes), _join_bytes(heldout_bytes)
    else:
        # A single file: hold out its tail instead, so evaluation still sees unseen text.
        whole = _join_bytes(train_bytes)
        cut = len(whole) - max(1, int(len(whole) * HELDOUT_FRACTION))
        train, heldout = whole[:cut], whole[cut:]

    fingerprint = _fingerprint(["text", "vocab=256"] + [f"{p}\t{sizes[p]}" for p in relpaths])
    return Corpus(
        name=name,
        train=train,
        heldout=heldout,
        vocab_size=256,
        fingerprint=fingerprint,
        train_files=tuple(train_files),
        heldout_files=tuple(heldout_files),
    )


# --- nanoGPT .bin corpora -----------------------------------------------------------------------


def _open_bin(path: Path) -> np.ndarray:
    if not path.exists():
        raise DataError(f"{str(path)!r} is missing (a .bin corpus needs train.bin and val.bin)")
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise DataError(f"{str(path)!r} has {size} bytes; expected a non-empty array of uint16 tokens")
    try:
        return np.memmap(path, dtype=np.uint16, mode="r")
    except OSError as exc:
        raise DataError(f"cannot memory-map {str(path)!r}: {exc}") from exc


def _bin_vocab_size(folder: Path, train: np.ndarray, heldout: np.ndarray) -> int:
    meta_path = folder / "meta.json"
    if meta_path.exists():
        try:
            vocab_size = json.loads(meta_path.read_text())["vocab_size"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{str(meta_path)!r} must be JSON like {{\"vocab_size\": N}}: {exc}") from exc
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise DataError(f"{str(meta_path)!r}: vocab_size must be a positive int, got {vocab_size!r}")
        return vocab_size
    # No metadata: the smallest vocabulary that covers every token (one pass over the data).
    return int(max(train.max(), heldout.max())) + 1


def _load_bin_folder(folder: Path) -> Corpus:
    train = _open_bin(folder / "train.bin")
    heldout = _open_bin(folder / "val.bin")
    vocab_size = _bin_vocab_size(folder, train, heldout)
    fingerprint = _fingerprint(
        ["bin", f"vocab={vocab_size}", f"train.bin\t{train.nbytes}", f"val.bin\t{heldout.nbytes}"]
    )
    return Corpus(
        name=folder.resolve().name,
        train=train,
        heldout=heldout,
        vocab_size=vocab_size,
        fingerprint=fingerprint,
    )


# --- windows and batches ------------------------------------------------------------------------


def _derived_seed(*parts: int) -> int:
    """A 63-bit seed mixing several integers, so (seed, shard, epoch) streams are unrelated."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _permutation(n: int, seed: int) -> Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def _gather_windows(tokens: TokenArray, window_ids: Tensor, block_size: int) -> Batch:
    """Inputs and next-token targets (int64, shape (len(window_ids), block_size))."""
    span = block_size + 1
    index = window_ids.view(-1, 1) * span + torch.arange(span)
    if isinstance(tokens, Tensor):
        windows = tokens[index].long()
    else:
        windows = torch.from_numpy(tokens[index.numpy()].astype(np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class ShardSampler:
    """Endless batches from one worker's disjoint shard of the corpus's train windows."""

    def __init__(
        self,
        corpus: Corpus,
        block_size: int,
        batch_size: int,
        seed: int,
        shard_index: int = 0,
        num_shards: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size and batch_size must be >= 1, got {block_size}, {batch_size}")
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"need 0 <= shard_index < num_shards, got {shard_index}, {num_shards}")
        num_windows = len(corpus.train) // (block_size + 1)
        if num_windows < num_shards:
            raise DataError(
                f"corpus {corpus.name!r} has {num_windows} train windows of {block_size + 1} tokens, "
                f"too few for {num_shards} shards"
            )
        self.corpus = corpus
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.device = device
        # Every worker computes the same deal, then keeps only its own hand.
        self.windows = _permutation(num_windows, seed)[shard_index::num_shards].clone()
        self.epoch = 0
        self.position = 0  # windows already consumed in the current epoch
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        """Number of windows in this shard (one epoch)."""
        return len(self.windows)

    def _epoch_order(self, epoch: int) -> Tensor:
        shuffle = _permutation(len(self.windows), _derived_seed(self.seed, self.shard_index, epoch))
        return self.windows[shuffle]

    def next_window_ids(self) -> Tensor:
        """Ids of the next batch_size windows, moving into the next epoch when one runs out."""
        chunks, needed = [], self.batch_size
        while needed:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(needed, len(self._order) - self.position)
            chunks.append(self._order[self.position : self.position + take])
            self.position += take
            needed -= take
        return torch.cat(chunks)

    def next_batch(self) -> Batch:
        """Next (x, y) int64 batch of shape (batch_size, block_size)."""
        x, y = _gather_windows(self.corpus.train, self.next_window_ids(), self.block_size)
        if self.device is not None:
            x, y = x.to(self.device), y.to(self.device)
        return x, y

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler is, plus what it was built from (checked on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "block_size": self.block_size,
            "fingerprint": self.corpus.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved epoch/position; refuses state from a differently built sampler."""
        for key in ("seed", "shard_index", "num_shards", "block_size", "fingerprint"):
            mine = getattr(self, key) if key != "fingerprint" else self.corpus.fingerprint
            if key in state and state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {mine!r}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.windows):
            raise ValueError(f"sampler state out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)


# --- held-out evaluation ------------------------------------------------------------------------


def heldout_batches(corpus: Corpus, block_size: int, batch_size: int, num_batches: int) -> list[Batch]:
    """A fixed list of held-out batches, the same for every worker and every run seed."""
    num_windows = len(corpus.heldout) // (block_size + 1)
    if num_windows == 0:
        raise DataError(
            f"held-out split of {corpus.name!r} has {len(corpus.heldout)} tokens, "
            f"fewer than one window of {block_size + 1}"
        )
    needed = batch_size * num_batches
    # Distinct windows while they last; a small held-out set is cycled rather than refused.
    order = _permutation(num_windows, HELDOUT_SEED).repeat(-(-needed // num_windows))[:needed]
    return [
        _gather_windows(corpus.heldout, ids, block_size) for ids in order.view(num_batches, batch_size)
    ]


def _model_device(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def evaluate(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor],
    batches: list[Batch],
    device: torch.device | str | None = None,
) -> float:
    """Mean loss over batches, in eval mode without gradients; restores the training mode."""
    if not batches:
        raise ValueError("evaluate() needs at least one batch")
    device = device if device is not None else _model_device(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            losses = [float(loss_fn(model, x.to(device), y.to(device))) for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)
