"""nanoGPT-style corpora: a folder with ``train.bin`` and ``val.bin`` of uint16 tokens, memory-mapped,
and an optional ``meta.json`` with ``{"vocab_size": N}``. Without it the largest token sets the
vocabulary, remembered in a small hidden file next to train.bin (a full scan of a large corpus
on every start is too slow). With it, val.bin and a sample of train.bin are checked against it
(every batch is checked too, see `batches._gather_windows`)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from .data import Corpus, DataError, _fingerprint

_UINT16_VOCAB = 1 << 16  # .bin tokens are uint16: ids 0..65535
# train.bin is checked against meta.json on these many evenly spaced contiguous chunks (4M tokens,
# 8 MB read), not in full: a full scan of a 17 GB corpus on every start is too slow.
_SAMPLE_CHUNK, _SAMPLE_CHUNKS = 1 << 16, 64
_MAX_TOKEN_CACHE = ".train.bin.max-token.json"  # next to train.bin, when there is no meta.json


def _open_bin(path: Path) -> np.ndarray:
    if not path.exists():
        raise DataError(f"{str(path)!r} is missing (a .bin corpus needs train.bin and val.bin)")
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise DataError(f"{str(path)!r} has {size} bytes; expected a non-empty array of uint16 tokens")
    try:
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    except OSError as exc:
        raise DataError(f"cannot memory-map {str(path)!r}: {exc}") from exc
    _refuse_wider_tokens(path, tokens)
    return tokens


def _refuse_wider_tokens(path: Path, tokens: np.ndarray) -> None:
    """DataError if the file looks like uint32 (or wider) tokens read as uint16: every second
    word 0. Read as uint16, such a file was taken without a word (half its tokens 0, a review
    found), as a tokenizer with over 65,536 ids writes them."""
    head = np.asarray(tokens[: _SAMPLE_CHUNK - _SAMPLE_CHUNK % 2])
    if len(head) < 2048:
        return  # (too short to tell)
    # uint32 ids under 2**20 (a 1M-id vocabulary) have a high word of at most 15; uint16 ids of
    # real text are seldom that small at every second place and larger at the others
    odd_small, even_small = float((head[1::2] <= 15).mean()), float((head[0::2] <= 15).mean())
    # (real uint16 text looks alike at both; int64's even words are half 0 high words, so even a
    # character vocabulary's many small ids leave them well under 0.95; a third review)
    if odd_small > 0.99 and even_small < 0.95:
        raise DataError(f"{str(path)!r} looks like uint32 (or wider) tokens: every second 16-bit word is 0. "
                        "groundswell reads uint16 tokens (at most 65,536 ids): write the arrays as uint16")


def _sampled_max(tokens: np.ndarray) -> int:
    """Largest token in evenly spaced contiguous chunks of `tokens` (all of it when small)."""
    n = len(tokens)
    if n <= _SAMPLE_CHUNK * _SAMPLE_CHUNKS:
        return int(tokens.max())
    # contiguous chunks, not a stride: a token per page would read every page of the file
    starts = np.linspace(0, n - _SAMPLE_CHUNK, _SAMPLE_CHUNKS).astype(np.int64)
    return max(int(tokens[s : s + _SAMPLE_CHUNK].max()) for s in starts)


def _cached_max(path: Path, tokens: np.ndarray) -> int:
    """Largest token of the .bin file at `path`, remembered next to it (keyed by its size, mtime
    and inode) so a large corpus is scanned once, not on every start; a cache that cannot be
    written is skipped."""
    st = path.stat()
    key = [st.st_size, st.st_mtime_ns, st.st_ino]
    cache = path.parent / _MAX_TOKEN_CACHE
    try:
        saved = json.loads(cache.read_text())
        top = saved["max_token"]
        if saved["key"] == key and isinstance(top, int) and 0 <= top < _UINT16_VOCAB:
            return top
    except (OSError, ValueError, KeyError, TypeError):
        pass
    top = int(tokens.max())
    tmp = None
    try:
        # written whole then renamed: peers starting together never read half a file
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_MAX_TOKEN_CACHE + ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "max_token": top}, f)
        os.replace(tmp, cache)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return top


def _bin_vocab_size(folder: Path, train: np.ndarray, heldout: np.ndarray) -> int:
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        # No metadata: the smallest vocabulary that covers every token.
        return max(_cached_max(folder / "train.bin", train), int(heldout.max())) + 1
    try:
        vocab_size = json.loads(meta_path.read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{str(meta_path)!r} must be JSON like {{\"vocab_size\": N}}: {exc}") from exc
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataError(f"{str(meta_path)!r}: vocab_size must be a positive int, got {vocab_size!r}")
    if vocab_size > _UINT16_VOCAB:
        raise DataError(
            f"{str(meta_path)!r}: vocab_size {vocab_size} does not fit uint16 tokens (at most {_UINT16_VOCAB}); "
            f"train.bin and val.bin cannot hold its ids"
        )
    # A token >= vocab_size would be an IndexError mid-run (a device-side assert on CUDA).
    for name, top in (("val.bin", int(heldout.max())), ("train.bin", _sampled_max(train))):
        if top >= vocab_size:
            raise DataError(
                f"{str(folder / name)!r} holds token {top}, but meta.json says vocab_size {vocab_size}: "
                f"fix meta.json or tokenize again"
            )
    return vocab_size


def load_bin_folder(folder: Path) -> Corpus:
    """A folder with train.bin and val.bin (uint16 tokens, memory-mapped) as a corpus."""
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
