"""Tests for the data pipeline: corpora, disjoint shards, resumable samplers, held-out set."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from groundswell.peer.batches import ShardSampler, evaluate, heldout_batches
from groundswell.peer.data import (
    FILE_SEPARATOR,
    Corpus,
    DataError,
    load_corpus,
)
from torch import nn


@pytest.fixture(scope="session")
def stdlib_corpus() -> Corpus:
    return load_corpus("stdlib")


def _rows(x: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(row.tolist()) for row in x}


def _drain_window_ids(sampler: ShardSampler, num_batches: int) -> list[int]:
    return [i for _ in range(num_batches) for i in sampler.next_window_ids().tolist()]


# --- stdlib corpus ------------------------------------------------------------------------------


def test_stdlib_corpus_is_real_python_source(stdlib_corpus: Corpus) -> None:
    c = stdlib_corpus
    assert c.name == "stdlib" and c.vocab_size == 256
    assert c.train.dtype == torch.uint8 and c.train.dim() == 1
    assert len(c.train) > 5_000_000 and len(c.heldout) > 100_000
    assert c.num_tokens == len(c.train) + len(c.heldout)
    assert all(p.endswith(".py") for p in c.train_files + c.heldout_files)
    assert not any("site-packages" in p or "dist-packages" in p for p in c.train_files + c.heldout_files)
    assert bytes(c.train[:1_000_000].numpy()).count(b"def ") > 100
    assert len(c.fingerprint) == 16 and int(c.fingerprint, 16) >= 0


def test_stdlib_heldout_files_are_disjoint_from_train(stdlib_corpus: Corpus) -> None:
    c = stdlib_corpus
    train, heldout = set(c.train_files), set(c.heldout_files)
    assert train.isdisjoint(heldout)
    assert list(c.train_files) == sorted(c.train_files)  # deterministic order
    fraction = len(heldout) / (len(train) + len(heldout))
    assert 0.02 < fraction < 0.10
    # The train stream is exactly the train files plus one separator between each pair.
    root = Path(sysconfig.get_paths()["stdlib"])
    train_bytes = sum((root / p).stat().st_size for p in c.train_files)
    assert len(c.train) == train_bytes + len(c.train_files) - 1


def test_stdlib_load_is_deterministic(stdlib_corpus: Corpus) -> None:
    again = load_corpus("stdlib")
    assert again.fingerprint == stdlib_corpus.fingerprint
    assert again.heldout_files == stdlib_corpus.heldout_files
    assert torch.equal(again.heldout, stdlib_corpus.heldout)


# --- shard sampler ------------------------------------------------------------------------------


def test_shards_are_disjoint_and_cover_the_windows(stdlib_corpus: Corpus) -> None:
    samplers = [ShardSampler(stdlib_corpus, 128, 16, seed=7, shard_index=i, num_shards=3) for i in range(3)]
    shards = [set(s.windows.tolist()) for s in samplers]
    for i in range(3):
        for j in range(i + 1, 3):
            assert shards[i].isdisjoint(shards[j])
    assert set().union(*shards) == set(range(len(stdlib_corpus.train) // 129))
    # Different shards hand out different data.
    xs = [s.next_batch()[0] for s in samplers]
    assert _rows(xs[0]).isdisjoint(_rows(xs[1])) and _rows(xs[1]).isdisjoint(_rows(xs[2]))


def test_sampler_is_deterministic_across_constructions(stdlib_corpus: Corpus) -> None:
    a = ShardSampler(stdlib_corpus, 64, 8, seed=3, shard_index=1, num_shards=4)
    b = ShardSampler(stdlib_corpus, 64, 8, seed=3, shard_index=1, num_shards=4)
    for _ in range(5):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other_seed = ShardSampler(stdlib_corpus, 64, 8, seed=4, shard_index=1, num_shards=4)
    assert not torch.equal(other_seed.windows, a.windows)


def test_batches_are_shifted_next_token_pairs(stdlib_corpus: Corpus) -> None:
    sampler = ShardSampler(stdlib_corpus, 32, 4, seed=0)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256


def test_epochs_visit_every_window_once_in_new_orders(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 8)
    corpus = load_corpus(str(tmp_path))
    sampler = ShardSampler(corpus, 7, 3, seed=1, shard_index=1, num_shards=2)
    n = len(sampler)
    seen = _drain_window_ids(sampler, 4 * n)  # 3 * 4n ids = 12 full epochs
    epochs = [seen[k * n : (k + 1) * n] for k in range(12)]
    assert all(sorted(e) == sorted(sampler.windows.tolist()) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    # The next epoch starts lazily, on the next request.
    assert sampler.epoch == 11 and sampler.position == n


def test_sampler_state_round_trip_resumes_exactly(stdlib_corpus: Corpus) -> None:
    corpus = Corpus(  # a short stream, so the resumed run crosses epoch boundaries
        name="short", train=stdlib_corpus.train[:20_000], heldout=stdlib_corpus.heldout[:5_000],
        vocab_size=256, fingerprint="short",
    )
    original = ShardSampler(corpus, 16, 5, seed=11, shard_index=2, num_shards=3)
    for _ in range(100):  # 500 windows: past the first epoch of this 392-window shard
        original.next_batch()
    state = original.state_dict()
    assert state["epoch"] >= 1 and 0 < state["position"] < len(original)
    expected = [original.next_batch() for _ in range(200)]

    resumed = ShardSampler(corpus, 16, 5, seed=11, shard_index=2, num_shards=3)
    resumed.load_state_dict(state)
    for (xe, ye), (xr, yr) in zip(expected, (resumed.next_batch() for _ in range(200))):
        assert torch.equal(xe, xr) and torch.equal(ye, yr)
    assert resumed.state_dict() == original.state_dict()
    assert original.epoch > state["epoch"]

    wrong_shard = ShardSampler(corpus, 16, 5, seed=11, shard_index=0, num_shards=3)
    with pytest.raises(ValueError, match="shard_index"):
        wrong_shard.load_state_dict(state)


def test_sampler_rejects_bad_arguments(stdlib_corpus: Corpus) -> None:
    with pytest.raises(ValueError):
        ShardSampler(stdlib_corpus, 64, 8, seed=0, shard_index=3, num_shards=3)
    with pytest.raises(ValueError):
        ShardSampler(stdlib_corpus, 0, 8, seed=0)
    ten_zeros = torch.zeros(10, dtype=torch.uint8)
    tiny = Corpus(name="t", train=ten_zeros, heldout=ten_zeros, vocab_size=256, fingerprint="t")
    with pytest.raises(DataError, match="too few"):
        ShardSampler(tiny, 8, 1, seed=0, shard_index=0, num_shards=4)


# --- held-out set -------------------------------------------------------------------------------


def test_heldout_batches_are_fixed_across_calls_and_seeds(stdlib_corpus: Corpus) -> None:
    torch.manual_seed(1)
    first = heldout_batches(stdlib_corpus, 64, 4, 3)
    torch.manual_seed(2)
    second = heldout_batches(stdlib_corpus, 64, 4, 3)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second):
        assert x1.shape == (4, 64)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    heldout_rows = _rows(first[0][0])
    train_rows = _rows(ShardSampler(stdlib_corpus, 64, 64, seed=0).next_batch()[0])
    assert heldout_rows.isdisjoint(train_rows)


def test_evaluate_returns_mean_loss_and_restores_mode(stdlib_corpus: Corpus) -> None:
    batches = heldout_batches(stdlib_corpus, 16, 2, 2)
    model = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
    model.train()

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert not m.training and not torch.is_grad_enabled()
        return nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())

    loss = evaluate(model, loss_fn, batches)
    assert model.training
    model.eval()
    with torch.no_grad():
        manual = sum(float(loss_fn(model, x, y)) for x, y in batches) / len(batches)
    assert loss == pytest.approx(manual)
    assert 4.0 < loss < 7.0  # roughly ln(256) = 5.55 for an untrained model


# --- other corpus formats -----------------------------------------------------------------------


def test_text_folder_corpus(tmp_path: Path) -> None:
    files = {f"doc{i:02d}.txt": f"document number {i} ".encode() * 40 for i in range(40)}
    files["sub/nested.md"] = b"# nested\n" * 50
    for rel, content in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(content)
    (tmp_path / ".hidden").write_bytes(b"secret")

    corpus = load_corpus(str(tmp_path))
    assert corpus.vocab_size == 256 and corpus.name == tmp_path.name
    assert set(corpus.train_files) | set(corpus.heldout_files) == set(files)
    assert corpus.heldout_files and set(corpus.train_files).isdisjoint(corpus.heldout_files)
    train_bytes = bytes(corpus.train.numpy())
    for rel in corpus.heldout_files:
        assert files[rel] not in train_bytes
    expected_train = bytes([FILE_SEPARATOR]).join(files[rel] for rel in corpus.train_files)
    assert train_bytes == expected_train
    assert load_corpus(str(tmp_path)).fingerprint == corpus.fingerprint
    (tmp_path / "doc00.txt").write_bytes(b"changed")
    assert load_corpus(str(tmp_path)).fingerprint != corpus.fingerprint


def test_few_files_still_get_a_heldout_split(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"a" * 500)
    (tmp_path / "b.txt").write_bytes(b"b" * 500)
    two = load_corpus(str(tmp_path))  # one whole file of two would hold out half the corpus
    assert two.train_files == ("a.txt", "b.txt") and two.heldout_files == ()
    assert bytes(two.train.numpy()) == b"a" * 475 + b"\0" + b"b" * 475
    assert bytes(two.heldout.numpy()) == b"a" * 25 + b"\0" + b"b" * 25

    for name in ("a.txt", "short.txt", "x", "input.txt"):  # whatever its name hashes to,
        (tmp_path / name).write_bytes(b"a" * 500)  # a single file holds out its tail
        single = load_corpus(str(tmp_path / name))
        assert len(single.heldout) == 25 and len(single.train) == 475


def test_bin_corpus(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    train = rng.integers(0, 1000, size=5000, dtype=np.uint16)
    val = rng.integers(0, 1000, size=600, dtype=np.uint16)
    train[17] = 1233  # the largest token sets the vocab when there is no meta.json
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")

    corpus = load_corpus(str(tmp_path))
    assert corpus.vocab_size == 1234
    assert isinstance(corpus.train, np.memmap) and len(corpus.train) == 5000 and len(corpus.heldout) == 600
    sampler = ShardSampler(corpus, 32, 4, seed=0, shard_index=0, num_shards=2)
    x, y = sampler.next_batch()
    ids = sampler._order[:4]
    assert x.dtype == torch.int64 and x.shape == (4, 32)
    first = int(ids[0]) * 33  # window id * (block_size + 1)
    assert torch.equal(x[0], torch.from_numpy(train[first : first + 32].astype(np.int64)))
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert heldout_batches(corpus, 32, 2, 2)[0][0].shape == (2, 32)

    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50304}))
    assert load_corpus(str(tmp_path)).vocab_size == 50304
    (tmp_path / "meta.json").write_text("not json")
    with pytest.raises(DataError, match="meta.json"):
        load_corpus(str(tmp_path))


def test_clear_errors_for_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no files"):
        load_corpus(str(empty))
    (empty / "zero.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(empty))
    bins = tmp_path / "bins"
    bins.mkdir()
    np.arange(10, dtype=np.uint16).tofile(bins / "train.bin")
    with pytest.raises(DataError, match="val.bin"):
        load_corpus(str(bins))
    (bins / "val.bin").write_bytes(b"\x01\x02\x03")  # odd size: not uint16
    with pytest.raises(DataError, match="uint16"):
        load_corpus(str(bins))
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 100)
    with pytest.raises(DataError, match="held-out"):
        heldout_batches(load_corpus(str(short)), 64, 1, 1)


def test_unreadable_file_is_a_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ok.txt").write_bytes(b"hello")
    (tmp_path / "bad.txt").write_bytes(b"world")
    real_open = Path.open

    def failing_open(self: Path, *args, **kwargs):  # root reads anything: stand in for the OS refusing
        if self.name == "bad.txt":
            raise PermissionError("permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", failing_open)
    with pytest.raises(DataError, match="bad.txt"):
        load_corpus(str(tmp_path))


# --- the split of text folders by bytes, not by files ---------------------------------------------


def _tails(files: dict[str, bytes]) -> tuple[bytes, bytes]:
    """The train and held-out streams of a split that holds out the last 5% of every file."""
    cuts = {rel: len(content) - int(len(content) * 0.05) for rel, content in files.items()}
    train = b"\0".join(files[rel][: cuts[rel]] for rel in sorted(files))
    heldout = b"\0".join(files[rel][cuts[rel] :] for rel in sorted(files) if cuts[rel] < len(files[rel]))
    return train, heldout


@pytest.mark.parametrize("sizes", [
    {"input.txt": 20_000, "README.md": 479},  # the big file used to be held out whole: trained on the README
    {"input.txt": 20_000, "notes10.md": 479},  # a few files: no evaluating on the notes alone either
    {**{f"doc{i:02d}.txt": 300 for i in range(40)}, "doc03.txt": 20_000},  # under 5% by hash, most by bytes
])
def test_a_file_that_is_most_of_the_corpus_is_never_held_out_whole(tmp_path: Path, sizes: dict[str, int]) -> None:
    files = {rel: (rel.encode() + b" text ") * (n // 10) for rel, n in sizes.items()}
    for rel, content in files.items():
        (tmp_path / rel).write_bytes(content)
    corpus = load_corpus(str(tmp_path))
    assert corpus.heldout_files == () and set(corpus.train_files) == set(files)
    train, heldout = _tails(files)
    assert bytes(corpus.train.numpy()) == train and bytes(corpus.heldout.numpy()) == heldout
    assert 0.04 < len(heldout) / (len(train) + len(heldout)) < 0.06
    again = load_corpus(str(tmp_path))
    assert again.fingerprint == corpus.fingerprint and torch.equal(again.heldout, corpus.heldout)


def test_a_corpus_too_small_to_split_is_refused(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_bytes(b"x")  # used to load with an empty train stream
    with pytest.raises(DataError, match="too little to split into train and held-out"):
        load_corpus(str(tmp_path / "one.txt"))


def test_loading_a_text_corpus_holds_it_about_once(tmp_path: Path) -> None:
    import tracemalloc

    for i in range(20):
        (tmp_path / f"doc{i:02d}.txt").write_bytes(bytes([65 + i]) * 50_000)
    tracemalloc.start()
    try:
        corpus = load_corpus(str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert corpus.num_tokens >= 1_000_000
    assert peak < 1.3 * corpus.num_tokens  # was about 3x: the files, their join and a copy of it


# --- train.bin / val.bin folders ------------------------------------------------------------------


def _bin_folder(folder: Path, train: np.ndarray, val: np.ndarray, vocab_size: int | None = None) -> Path:
    folder.mkdir(exist_ok=True)
    train.astype(np.uint16).tofile(folder / "train.bin")
    val.astype(np.uint16).tofile(folder / "val.bin")
    if vocab_size is not None:
        (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return folder


@pytest.mark.parametrize("where, vocab_size, words", [
    ("val", 100, "val.bin' holds token 100, but meta.json says vocab_size 100"),
    ("train", 100, "train.bin' holds token 100, but meta.json says vocab_size 100"),
    (None, 70_000, "vocab_size 70000 does not fit uint16 tokens (at most 65536)"),
])
def test_bin_tokens_past_meta_vocab_size_are_refused_at_load(tmp_path: Path, where, vocab_size, words) -> None:
    train, val = np.arange(1000) % 100, np.arange(200) % 100
    if where == "train":
        train[500] = 100
    if where == "val":
        val[7] = 100
    _bin_folder(tmp_path, train, val, vocab_size)
    with pytest.raises(DataError, match=re.escape(words)):
        load_corpus(str(tmp_path))


def test_a_bad_bin_token_the_load_did_not_sample_is_a_data_error_in_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from groundswell.peer import bin_corpus

    monkeypatch.setattr(bin_corpus, "_SAMPLE_CHUNK", 10)
    monkeypatch.setattr(bin_corpus, "_SAMPLE_CHUNKS", 2)  # samples train.bin's first and last 10 tokens only
    train = np.arange(1000) % 100
    train[500] = 60_000
    corpus = load_corpus(str(_bin_folder(tmp_path, train, np.arange(200) % 100, 100)))
    sampler = ShardSampler(corpus, block_size=9, batch_size=100, seed=0)  # one batch: every window
    with pytest.raises(DataError, match="holds token 60000, but its vocab_size is 100"):
        sampler.next_batch()


def test_the_inferred_bin_vocab_is_scanned_once_and_cached_next_to_train_bin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _bin_folder(tmp_path / "c", np.arange(1000) % 300, np.arange(200) % 100)
    assert load_corpus(str(folder)).vocab_size == 300
    cache = folder / ".train.bin.max-token.json"
    saved = json.loads(cache.read_text())
    cache.write_text(json.dumps({**saved, "max_token": 999}))  # proves the next load reads it, not the data
    assert load_corpus(str(folder)).vocab_size == 1000
    (np.arange(1002) % 400).astype(np.uint16).tofile(folder / "train.bin")  # another train.bin: scanned again
    assert load_corpus(str(folder)).vocab_size == 400

    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    cache.unlink()
    monkeypatch.setattr(tempfile, "mkstemp", refuse)  # a read-only corpus folder: no cache, still loads
    assert load_corpus(str(folder)).vocab_size == 400 and not cache.exists()


def test_a_file_of_a_bin_corpus_is_refused_not_read_as_text(tmp_path: Path) -> None:
    folder = _bin_folder(tmp_path / "owt", np.arange(1000) % 300, np.arange(200) % 100, 300)
    for name in ("train.bin", "val.bin", "meta.json"):
        with pytest.raises(DataError, match="give the folder that holds train.bin and val.bin"):
            load_corpus(str(folder / name))
    (tmp_path / "tokens.bin").write_bytes(b"\x01\x00" * 100)
    with pytest.raises(DataError, match="give the folder that holds train.bin and val.bin"):
        load_corpus(str(tmp_path / "tokens.bin"))
    (folder / "train.bin").unlink()  # val.bin alone is not a text folder either
    with pytest.raises(DataError, match="train.bin' is missing"):
        load_corpus(str(folder))


def test_the_folder_above_a_bin_corpus_is_refused_not_read_as_text(tmp_path: Path) -> None:
    # nanoGPT keeps data/<name>/{train,val}.bin: naming data/ read the token arrays as text,
    # val.bin among the training files (found by a review of the data path)
    (tmp_path / "data").mkdir()
    folder = _bin_folder(tmp_path / "data" / "shk", np.arange(1000) % 300, np.arange(200) % 100, 300)
    (folder / "prepare.py").write_text("print('tokenize')\n" * 50)
    with pytest.raises(DataError, match=f"holds a train.bin/val.bin corpus in '{folder}': give that folder"):
        load_corpus(str(tmp_path / "data"))
    assert load_corpus(str(folder)).vocab_size == 300


def test_a_file_name_that_is_not_utf8_is_named_in_a_data_error(tmp_path: Path) -> None:
    import os

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world " * 200)
    try:
        (folder / os.fsdecode(b"caf\xe9.txt")).write_text("bonjour " * 200)
    except (OSError, UnicodeEncodeError):
        pytest.skip("this filesystem refuses file names that are not UTF-8")
    with pytest.raises(DataError, match=r"the file name b'caf\\xe9.txt' .* is not UTF-8"):
        load_corpus(str(folder))


def test_each_epoch_after_the_first_cuts_the_stream_elsewhere_and_shards_stay_apart(tmp_path: Path) -> None:
    # Found by a review of the training workload: window k was always tokens[k*(T+1):(k+1)*(T+1)],
    # so each epoch repeated the same sequences and one token in T+1 was never a target.
    block = 7
    stream = torch.randint(0, 256, (4099,), generator=torch.Generator().manual_seed(0))  # windows are unique
    where = {tuple(stream[s:s + block + 1].tolist()): s for s in range(len(stream) - block)}
    corpus = Corpus(name="t", train=stream.to(torch.uint8), heldout=stream[:64].to(torch.uint8), vocab_size=256,
                    fingerprint="t")
    samplers = [ShardSampler(corpus, block, 4, seed=3, shard_index=i, num_shards=2) for i in range(2)]
    span, n = block + 1, len(samplers[0])
    starts_by_epoch: list[list[set[int]]] = [[set(), set()] for _ in range(3)]
    for i, sampler in enumerate(samplers):
        for _ in range(3 * n // 4):
            epoch_before = sampler.epoch if sampler.position < len(sampler._order) else sampler.epoch + 1
            x, y = sampler.next_batch()
            assert torch.equal(x[:, 1:], y[:, :-1])
            for row in torch.cat([x, y[:, -1:]], dim=1):
                start = where.get(tuple(row.tolist()))
                assert start is not None, "a window is not a contiguous piece of the stream"
                starts_by_epoch[min(epoch_before, 2)][i].add(start)
    from collections import Counter

    cuts = [Counter(s % span for shard in epoch for s in shard) for epoch in starts_by_epoch[:2]]
    assert set(cuts[0]) == {0}
    (offset, count), = cuts[1].most_common(1)  # one cut for the epoch, a new one (a window at the end wraps)
    assert offset != 0 and count >= sum(cuts[1].values()) - 1
    for epoch in starts_by_epoch[:2]:
        assert not epoch[0] & epoch[1], "two shards read the same window in one epoch"



def test_window_ids_are_held_as_int32_and_batches_are_those_of_int64_ids(tmp_path: Path) -> None:
    # Two arrays of one id per window (the shard's ids, the epoch's order): ~1 GB each in int64
    # for a 9B-token train.bin at block size 128 (found by a review of the data path). The order,
    # and so every batch and a resumed position, must stay what it was with int64 ids.
    corpus = Corpus("x", torch.randint(0, 256, (50_000,), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(3)), torch.zeros(300, dtype=torch.uint8),
                    256, "fp")
    sampler = ShardSampler(corpus, 16, 7, seed=4, shard_index=1, num_shards=3)
    assert sampler.windows.dtype == torch.int32 and sampler._order.dtype == torch.int32
    ids64 = torch.randperm(50_000 // 17, generator=torch.Generator().manual_seed(4))[1::3]
    assert torch.equal(sampler.windows.long(), ids64)
    ids = torch.cat([sampler.next_window_ids() for _ in range(200)])  # past an epoch of 980 windows
    assert ids.dtype == torch.int64 and sampler.epoch >= 1
    expected_first = ids64[torch.randperm(len(ids64), generator=torch.Generator().manual_seed(
        __import__("groundswell.peer.batches", fromlist=["_derived_seed"])._derived_seed(4, 1, 0)))]
    assert torch.equal(ids[:len(ids64)], expected_first)
    x, y = sampler.next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == (7, 16)


@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_bin_tokens_wider_than_uint16_are_refused_not_read_as_two_tokens_each(tmp_path: Path, dtype) -> None:
    # Found by a review (2026-12-07): a tokenizer with over 65,536 ids writes uint32; read as
    # uint16, each token became two (half of them 0), and training went on with no word.
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50_000, size=5000)
    ids[::3] += 150_000  # a 200k-id vocabulary: a third of the ids past 65,536
    ids.astype(dtype).tofile(tmp_path / "train.bin")
    rng.integers(0, 50_000, size=5000).astype(np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(DataError, match="looks like uint32 .or wider. tokens: every second 16-bit word is 0"):
        load_corpus(str(tmp_path))
    # int64 ids of a character vocabulary (many ids <= 15): its even words are half 0 too (a review)
    (rng.integers(0, 100, size=5000) * (rng.random(5000) > 0.3)).astype(np.int64).tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match="looks like uint32"):
        load_corpus(str(tmp_path))
    # uint16 tokens, 0 among them as often as any other id, are taken
    rng.integers(0, 4, size=5000).astype(np.uint16).tofile(tmp_path / "train.bin")
    assert load_corpus(str(tmp_path)).vocab_size >= 4


def test_a_few_files_named_valid_or_test_are_the_held_out_text(tmp_path: Path) -> None:
    # Found by a review (2026-12-07): wikitext's layout (wiki.train.raw, wiki.valid.raw,
    # wiki.test.raw) had the tail of every file held out, so 95% of its own validation and test
    # text was trained on, and the held-out loss was mostly the train file's tail.
    (tmp_path / "wiki.train.raw").write_bytes(b"t" * 200_000)
    (tmp_path / "wiki.valid.raw").write_bytes(b"v" * 20_000)
    (tmp_path / "wiki.test.raw").write_bytes(b"s" * 20_000)
    corpus = load_corpus(str(tmp_path))
    assert corpus.train_files == ("wiki.train.raw",)
    assert corpus.heldout_files == ("wiki.test.raw", "wiki.valid.raw")
    assert set(bytes(corpus.train.numpy())) == {ord("t")}
    assert set(bytes(corpus.heldout.numpy())) == {ord("s"), ord("v"), 0}
    # a word inside a name is not one ("latest", "devices"): those files are train text
    for name in ("latest.txt", "devices.txt"):
        (tmp_path / name).write_bytes(b"t" * 100)
    assert set(load_corpus(str(tmp_path)).heldout_files) == {"wiki.test.raw", "wiki.valid.raw"}
    # too little named text to evaluate on (an empty test.txt, a few lines of dev notes), or more
    # than is left to train on: the tails of every file, as before (a second review)
    for name in ("wiki.valid.raw", "wiki.test.raw"):
        (tmp_path / name).write_bytes(b"v" * 100)
    assert load_corpus(str(tmp_path)).heldout_files == ()
