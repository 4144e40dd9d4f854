"""A volunteer restarting from its own checkpoints: old ones are pruned without losing the newest,
and the work it had not sent (error feedback, local progress) is taken back unless the process
before it may have sent that work already."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from groundswell.peer.run_state import GlobalState


def _factory(tmp_path, corpus, **sections):
    """() -> a new Participant process of an open run (`sections` added to its manifest), all
    sharing one identity and one state dir, as restarts of the same volunteer do."""
    from groundswell.peer.manifest import manifest_from_mapping, sign_manifest
    from groundswell.peer.participant import Participant
    from groundswell.peer.swarm import NodeOptions
    from groundswell.protocol.identity import Identity

    manifest = manifest_from_mapping({"run": {"id": "unit", "open": True}, "model": {"spec": "tiny"}, **sections})
    me = Identity.generate()
    me.save(tmp_path / "id.key")

    def participant():
        return Participant(manifest, sign_manifest(manifest, me).to_bytes(), me, str(tmp_path / "id.key"),
                           NodeOptions(), tmp_path / "state", corpus=corpus)

    return participant


def _offline(p) -> None:
    """No network: an empty decision book, and a swarm with nothing newer than our checkpoint."""
    p.node = SimpleNamespace(book=SimpleNamespace(committed={}), record_decision=lambda d, supersede=False: None,
                             update_record=lambda **k: None, cached_records={})
    p.fresh_records = lambda: {}  # (no records: nothing to catch up to, nothing said of the run)
    p.catch_up = lambda fresh=True: 0
    p.sync_state = lambda peers, min_round=-1: None


def _holding_error_at_round_3(p, value: float = 1.0) -> None:
    """A SparseLoCo process at round 3 whose error feedback is all `value`, its state published."""
    from groundswell.peer.participant import genesis_decision

    p.state_dir.mkdir(parents=True, exist_ok=True)
    p.outer.round_id = 3
    p.outer.error = value * torch.ones_like(p.outer.global_params)
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone()},
                              genesis_decision(p.identity, "unit"))


def test_work_made_after_a_damaged_contributed_json_was_seen_is_kept_by_the_next_restart(tmp_path, corpus):
    """A restart drops the work of a checkpoint when contributed.json is unreadable; a checkpoint
    it writes afterwards (nothing contributed meanwhile: the file is as it was) holds only its own
    work, which the restart after it kept dropping, every time, until a contribution rewrote the
    file (found by a review)."""
    from groundswell.peer.resume import resume_and_sync

    participant = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = participant()
    _holding_error_at_round_3(p)
    assert p.save_checkpoint(settled=True) is not None
    (p.state_dir / "contributed.json").write_bytes(b'{"round": 3, "att')  # torn

    second = participant()
    _offline(second)
    resume_and_sync(second, [])
    assert bool((second.outer.error == 0).all())  # dropped: it may have gone out
    _holding_error_at_round_3(second, 2.0)  # trained since, never sent
    assert second.save_checkpoint(settled=True) is not None

    third = participant()
    _offline(third)
    resume_and_sync(third, [])
    assert bool((third.outer.error == 2).all())  # the second process's own work is kept
    (p.state_dir / "contributed.json").write_bytes(b'{"round": 4, "att')  # damaged otherwise since: dropped
    fourth = participant()
    _offline(fourth)
    resume_and_sync(fourth, [])
    assert bool((fourth.outer.error == 0).all())


def test_a_stale_writer_never_puts_back_an_older_contributed_json(tmp_path, corpus):
    # Found by a review: a worker thread still writing a given-up attempt's marker (its fsync slow)
    # could rename after the next attempt's marker, and a restart then took the older attempt as
    # the last one it sent (a second contribution to an attempt, or work sent twice).
    from groundswell.peer.work_file import contributed_marker, read_contributed

    p = _factory(tmp_path, corpus)()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    assert p._remember_contribution(7, 2)
    assert not p._remember_contribution(7, 1)  # the stale one, late
    assert contributed_marker(read_contributed(p.state_dir)) == {7: 2}
    assert p._remember_contribution(8, 0)
    assert contributed_marker(read_contributed(p.state_dir)) == {8: 0}


def test_cleanup_never_deletes_the_checkpoint_just_written(tmp_path, corpus):
    """A newer checkpoint that cannot be read (the run resumed past it) must not count towards
    `keep`: it made the cleanup delete the checkpoint just written, leaving nothing good."""
    from groundswell.peer.participant import genesis_decision

    p = _factory(tmp_path, corpus, checkpoint={"every_rounds": 1, "keep": 2})()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    for r in (50, 51):
        (p.state_dir / f"checkpoint-{r:08d}.pt").write_bytes(b"garbled")
    for r in (1, 2, 3):
        p.outer.round_id = r
        p._snapshot = GlobalState(r, {"global_params": p.outer.global_params.clone()},
                                  genesis_decision(p.identity, "unit"))
        written = p.save_checkpoint()
        assert written is not None and written.exists()
    names = sorted(f.name for f in p.state_dir.glob("checkpoint-*.pt"))
    # keep = 2: the one just written and the one before it; newer files are left alone
    assert names == ["checkpoint-00000002.pt", "checkpoint-00000003.pt", "checkpoint-00000050.pt",
                     "checkpoint-00000051.pt"]
    assert p.load_checkpoint()["round"] == 3  # the garbled ones are skipped


@pytest.mark.parametrize("contributed_round,kept,damage", [(3, False, None), (5, False, None), (2, True, None),
                                                           (3, False, "flip"), (2, False, "flip"),
                                                           (3, False, "digit"), (3, False, "folder"),
                                                           (3, False, "truncate"), (3, False, "not-ours")])
def test_a_resumed_error_feedback_is_dropped_if_the_process_before_contributed_after_the_checkpoint(
        tmp_path, corpus, contributed_round, kept, damage):
    """SparseLoCo's error feedback in a checkpoint holds what the crashed process sent in later
    rounds; restoring it would send that work a second time. A damaged contributed.json (found by
    a review of the state files: it read as "never contributed", and the work went out twice)
    cannot tell, so the work is dropped then too."""
    from groundswell.peer.resume import resume_and_sync

    p = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})()
    _holding_error_at_round_3(p)
    assert p.save_checkpoint() is not None
    p._remember_contribution(contributed_round, 0)
    marker = p.state_dir / "contributed.json"
    raw = bytearray(marker.read_bytes())
    if damage == "flip":
        raw[1] ^= 0x40  # '{"round"' -> '{bround"'
    elif damage == "digit":  # one bit: round 3 reads as round 2, before the checkpoint (found by a review)
        raw[raw.index(b"3")] ^= 0x01
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "not-ours":
        raw = bytearray(json.dumps({"round": "3", "attempt": 0}).encode())
    if damage == "folder":  # unreadable at all (a review: as a bad sector's EIO, it read as "settled")
        marker.unlink()
        marker.mkdir()
    else:
        marker.write_bytes(bytes(raw))

    p.outer.error = torch.zeros_like(p.outer.global_params)  # a new process
    _offline(p)
    resume_and_sync(p, [])
    assert bool((p.outer.error == 1).all()) is kept
    assert bool((p.outer.error == 0).all()) is not kept


@pytest.mark.parametrize("contributed_round,kept", [(3, False), (2, True)])
def test_a_restart_takes_back_its_local_progress_unless_it_may_have_been_sent(tmp_path, corpus, contributed_round,
                                                                            kept):
    """A DiLoCo contribution a round left out is rebased into the local parameters: a checkpoint
    keeps it, and a restart trains on from it, unless the process before contributed since."""
    from groundswell.optim import copy_into_parameters
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import restore_local_progress, resume_and_sync, torch_load_params

    participant = _factory(tmp_path, corpus, outer={"algorithm": "diloco", "codec": "fp32"})
    p = participant()
    p.outer.round_id = 3
    progress = torch.randn(p.outer.global_params.numel())
    copy_into_parameters(p.outer.global_params + progress, p.outer.params)
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone(),
                                  "momentum_buffer": p.outer.momentum_buffer.clone()},
                              genesis_decision(p.identity, "unit"))
    assert p.save_checkpoint() is not None
    p._remember_contribution(contributed_round, 0)

    again = participant()  # a new process, with the same state dir
    _offline(again)
    resumed = resume_and_sync(again, [])
    torch_load_params(again)  # what the volunteer does once the inner state is loaded
    assert restore_local_progress(again, resumed) is kept
    local = again.outer.local_vector() - again.outer.global_params
    assert torch.allclose(local, progress if kept else torch.zeros_like(progress), atol=1e-6)
    events = [json.loads(line)["kind"] for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    assert ("unsent-work-dropped" in events) is not kept and ("local-progress-restored" in events) is kept


@pytest.mark.parametrize("case", ["caught-up", "still-behind", "round-behind", "hash-off", "no-records",
                                  "nothing-compared", "costlier", "foreign"])
def test_a_restart_catches_up_from_its_checkpoint_before_downloading_a_state(tmp_path, corpus, case):
    """Found by a review: a restarted volunteer downloaded the whole state every time (~800 MB at
    100m), though its checkpoint was current or a few rounds behind, within the aggregates peers
    keep. It now applies those first; a state is downloaded only where that does not get it to
    the run's round with agreeing hashes."""
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import resume_and_sync
    from groundswell.protocol.client import RoundBehind

    participant = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = participant()
    p.outer.round_id = 7
    p._snapshot = GlobalState(7, {"global_params": p.outer.global_params.clone()}, genesis_decision(p.identity, "unit"))
    path = p.save_checkpoint()
    if case == "foreign":  # copied in from another peer (maybe made up): checked against a downloaded state
        state = torch.load(path, weights_only=True)
        state["peer"] = "someone-else"
        del state["digest"]
        torch.save(state, path)
    again = participant()
    _offline(again)
    # (sparse aggregates carry each trainer's contribution: 2 rounds of 2,000 cost more than the state)
    trainers = 2000 if case == "costlier" else 3
    records = {f"t{i}": SimpleNamespace(round=9, params_hash="", earlier_hashes=[], trains=True) for i in range(trainers)}
    if case != "no-records":
        again.fresh_records = lambda: records

    def catch_up(fresh=True):
        if case == "round-behind":
            raise RoundBehind("the swarm is 20 rounds ahead")
        again.outer.round_id = 8 if case == "still-behind" else 9
        return again.outer.round_id - 7

    again.catch_up = catch_up
    again.agrees_with_swarm = lambda vacuous=True: (case != "hash-off") and (vacuous or case != "nothing-compared")
    synced: list[int] = []
    again.sync_state = lambda peers, min_round=-1: synced.append(min_round)
    resume_and_sync(again, [])
    events = [json.loads(line) for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    caught = [e for e in events if e["kind"] == "sync" and e.get("via") == "catch-up"]
    if case == "caught-up":
        assert synced == [] and again.outer.round_id == 9 and caught and caught[0]["rounds"] == 2
    else:
        assert len(synced) == 1 and not caught, (synced, caught)
    assert any(e["kind"] == "hash-mismatch" for e in events) is (case == "hash-off")


@pytest.mark.parametrize("from_checkpoint", [True, False])
def test_a_volunteer_whose_checkpoint_is_ahead_of_every_peer_carries_on_from_it(tmp_path, corpus, from_checkpoint):
    """A coordinator restarted from an older checkpoint answers with an older state: a volunteer
    resuming from a newer one goes on from its own (it used to exit: "is the run still up?").
    A fresh volunteer with nobody to take a state from still stops with one clear line."""
    from groundswell.peer.net_errors import NetworkError
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import resume_and_sync
    from groundswell.peer.state_trust import NoNewerState

    participant = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = participant()
    if from_checkpoint:
        p.outer.round_id = 7
        p._snapshot = GlobalState(7, {"global_params": p.outer.global_params.clone()},
                                  genesis_decision(p.identity, "unit"))
        assert p.save_checkpoint() is not None
    again = participant()
    _offline(again)
    asked: list[int] = []

    def coordinator_behind(peers, min_round=-1):
        asked.append(min_round)
        raise NoNewerState("no peer holds a verifiable state of round 7 or later (1 answered with an older one)")

    again.sync_state = coordinator_behind
    if not from_checkpoint:
        with pytest.raises(NetworkError, match="no peer has the run's state yet"):
            resume_and_sync(again, [])
        return
    resume_and_sync(again, [])
    assert asked == [7] and again.outer.round_id == 7
    events = [json.loads(line)["kind"] for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    assert "resume-ahead" in events


@pytest.mark.parametrize("contributed_after_save", [False, True])
def test_work_a_checkpoint_holds_after_its_last_contributions_outcome_is_kept(tmp_path, corpus,
                                                                               contributed_after_save):
    """Ctrl+C in a round that ended in a retry: the final checkpoint, written once that outcome
    was known, still holds the work (a retry sends nothing anyone applied). A restart keeps it,
    unless the process contributed again after that checkpoint."""
    from groundswell.peer.resume import resume_and_sync

    participant = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = participant()
    _holding_error_at_round_3(p)
    p._remember_contribution(3, 0)  # round 3, attempt 0: retried, so the round stays 3
    assert p.save_checkpoint(settled=True) is not None
    if contributed_after_save:
        p._remember_contribution(3, 1)  # attempt 1 went out after the save: its outcome is not in it

    again = participant()
    _offline(again)
    resume_and_sync(again, [])
    assert bool((again.outer.error == 1).all()) is not contributed_after_save


def test_a_coordinator_whose_checkpoints_are_all_unreadable_refuses_a_new_genesis(tmp_path, corpus):
    # Starting the run over from a new round 0 under volunteers that are far past it would fork it
    from groundswell.peer.config import ConfigError
    from groundswell.peer.coordinator_role import run_coordinator
    from groundswell.peer.roles import StopFlag

    p = _factory(tmp_path, corpus)()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    (p.state_dir / "checkpoint-00000050.pt").write_bytes(b"garbled")

    def no_network():
        raise AssertionError("the network started: a new genesis was on its way")

    p.start_network = no_network
    with pytest.raises(ConfigError, match="none of the checkpoints .* can be read"):
        run_coordinator(p, stop=StopFlag())
    assert sorted(f.name for f in p.state_dir.glob("checkpoint-*.pt")) == ["checkpoint-00000050.pt"]


@pytest.mark.parametrize("book_has_the_commit", [True, False])
def test_a_checkpoint_written_between_a_rounds_apply_and_its_snapshot_is_of_one_round(tmp_path, corpus,
                                                                                    book_has_the_commit):
    """Found by a review of the state files: a network failure between applying a round and
    taking its snapshot saved the last round's parameters beside this round's optimizer state,
    under this round's name; a restart from it came back one outer step off."""
    from groundswell.peer.participant import genesis_decision

    p = _factory(tmp_path, corpus, outer={"algorithm": "diloco", "codec": "fp32"})()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    signed = genesis_decision(p.identity, "unit")
    p.outer.round_id = 3
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone(),
                                  "momentum_buffer": p.outer.momentum_buffer.clone()}, signed)
    p.outer.follow(3, torch.full_like(p.outer.global_params, 0.01))  # round 3 applied; no snapshot yet
    p.node = SimpleNamespace(book=SimpleNamespace(committed={3: (signed, None)} if book_has_the_commit else {}))
    written = p.save_checkpoint()
    if not book_has_the_commit:  # nothing to say which commit the state follows: no file rather than a mixed one
        assert written is None and not list(p.state_dir.glob("checkpoint-*.pt"))
        return
    state = torch.load(written, weights_only=True)
    assert written.name == "checkpoint-00000004.pt" and state["round"] == 4 and state["outer"]["round_id"] == 4
    assert torch.equal(state["tensors"]["global_params"], p.outer.global_params)
    assert torch.equal(state["tensors"]["momentum_buffer"], p.outer.momentum_buffer)
    assert torch.equal(state["outer"]["global_params"], state["tensors"]["global_params"])


def _keeping_two(tmp_path, corpus):
    """A volunteer that keeps 2 checkpoints, and save(r): its checkpoint of round r (asserted written)."""
    from groundswell.peer.participant import genesis_decision

    p = _factory(tmp_path, corpus, checkpoint={"every_rounds": 1, "keep": 2})()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    signed = genesis_decision(p.identity, "unit")

    def save(r: int) -> Path:
        p.outer.round_id = r
        p._snapshot = GlobalState(r, {"global_params": p.outer.global_params.clone()}, signed)
        written = p.save_checkpoint()
        assert written is not None
        return written

    return p, save


@pytest.mark.parametrize("damage", ["flipped-value", "renamed-digest", "garbled-pickle"])
def test_a_damaged_checkpoint_is_skipped_and_never_kept_in_place_of_a_good_one(tmp_path, corpus, damage):
    """Found by a review of the state files: a flipped bit in the digest's key name switched the
    digest off (torch.load does not check the archive's CRCs), and a checkpoint damaged inside
    counted towards `keep`, so the cleanup deleted the good one the run had resumed from. So did
    one whose archive is whole but whose pickle torch.load cannot read (a later review): that one
    is kept (torch.load may fail for a passing reason: memory, an older torch), but not counted."""
    p, save = _keeping_two(tmp_path, corpus)

    save(8)
    state = torch.load(save(9), weights_only=True)
    if damage == "flipped-value":
        state["tensors"]["global_params"][0] += 1.0
    elif damage == "renamed-digest":
        state["digesu"] = state.pop("digest")
    if damage == "garbled-pickle":  # a whole zip archive (as the pruner checks), its pickle garbage
        import zipfile

        (p.state_dir / "checkpoint-00000009.pt").unlink()
        with zipfile.ZipFile(p.state_dir / "checkpoint-00000009.pt", "w") as archive:
            archive.writestr("checkpoint-00000009/data.pkl", b"\x80\x02garbage")
            archive.writestr("checkpoint-00000009/version", b"3\n")
    else:
        torch.save(state, p.state_dir / "checkpoint-00000009.pt")
    assert p.load_checkpoint()["round"] == 8  # the damaged 9 is skipped
    save(12)  # the run went on from 8
    names = sorted(f.name for f in p.state_dir.glob("checkpoint-*.pt"))
    # (one torch cannot load is kept, not counted: memory running out, or an older torch, may pass)
    kept = ["checkpoint-00000009.pt"] if damage == "garbled-pickle" else []
    assert names == sorted(["checkpoint-00000008.pt", "checkpoint-00000012.pt", *kept])


@pytest.mark.parametrize("made_up", ["round-a-string", "outer-a-list", "tensors-a-list", "tensor-a-number",
                                     "nested-deep", "sparseloco-without-error"])
def test_a_made_up_checkpoint_with_a_matching_digest_is_skipped_not_half_taken(tmp_path, corpus, made_up):
    """Found by a review: the digest is no key, and a coordinator told to copy in a volunteer's
    checkpoint may be handed a made-up one: a round that is a string passed (and was taken half),
    tensors in a list or values nested deeper than Python recurses stopped the start with a
    traceback. Each is now skipped as damaged, for the older good one."""
    from groundswell.peer.checkpoint_check import DIGEST_KEY, checkpoint_digest

    p, save = _keeping_two(tmp_path, corpus)
    save(8)
    state = torch.load(save(9), weights_only=True)
    if made_up == "round-a-string":
        state["round"] = "9"
    elif made_up == "outer-a-list":
        state["outer"] = [1]
    elif made_up == "tensors-a-list":
        state["tensors"] = [state["tensors"]["global_params"]]
    elif made_up == "tensor-a-number":
        state["tensors"]["momentum_buffer"] = 1.5
    elif made_up == "sparseloco-without-error":  # (taken, it was a KeyError at resume; a review, 2026-12-07)
        state["outer"] = {**state["outer"], "algorithm": "sparseloco"}
        state["outer"].pop("error", None)
    else:
        deep: list = []
        for _ in range(3000):
            deep = [deep]
        state["unsettled"] = deep
    if made_up != "nested-deep":  # (its digest cannot be computed either: it is skipped all the same)
        state[DIGEST_KEY] = checkpoint_digest(state)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)  # (pickling it recurses too; loading it does not)
    try:
        torch.save(state, p.state_dir / "checkpoint-00000009.pt")
    finally:
        sys.setrecursionlimit(limit)
    assert p.load_checkpoint()["round"] == 8


def test_a_checkpoint_with_compressed_entries_is_not_loaded(tmp_path, corpus):
    """Found by a review: torch.load inflates compressed zip entries, so a made-up file of 98 KB
    loaded as 100 MB; torch.save stores every entry as it is, so a compressed one is not ours."""
    import zipfile

    p, save = _keeping_two(tmp_path, corpus)
    save(8)
    path = save(9)
    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    path.unlink()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            archive.writestr(name, data)
    assert torch.load(path, weights_only=True)["round"] == 9  # (torch itself would take it)
    assert p.load_checkpoint()["round"] == 8


def test_a_checkpoint_with_an_expanded_tensor_or_a_misshapen_vector_is_skipped(tmp_path, corpus):
    """Found by a review: a 2 KB file holding `zeros(1).expand(2**28)` (4 bytes of storage) made
    the digest check allocate 1 GiB (2**40: an out-of-memory error out of the loader, the older
    checkpoint never tried); global parameters of shape (n, 1) passed and failed later."""
    from groundswell.peer.checkpoint_check import DIGEST_KEY, checkpoint_digest

    p, save = _keeping_two(tmp_path, corpus)
    save(8)
    state = torch.load(save(9), weights_only=True)
    state["inner"] = {"junk": torch.zeros(1).expand(1 << 28)}
    state[DIGEST_KEY] = "0" * 64
    torch.save(state, p.state_dir / "checkpoint-00000009.pt")
    assert (p.state_dir / "checkpoint-00000009.pt").stat().st_size < 1 << 24  # (the model; the tensor spans 1 GiB)
    assert p.load_checkpoint()["round"] == 8
    assert p.state_dir / "checkpoint-00000009.pt" in p._unreadable  # refused as loaded, before its digest is worked out
    # a model's own small expanded buffer (state_dict keeps its strides) is no reason to refuse (a second review)
    from groundswell.peer.state_files import load_torch_file

    torch.save({"inner": {"model": {"s": torch.ones(1, 4).expand(8, 4)}}, "nested": [[[1]] * 3] * 2},
               tmp_path / "honest.pt")
    assert load_torch_file(tmp_path / "honest.pt")["inner"]["model"]["s"].shape == (8, 4)
    # nor a block a model shares 24 times (its state dict lists it 24 times, the file holds it once);
    # but one tensor listed a great many times (almost nothing in a file) is hashed as often
    block = torch.randn(256, 256)
    torch.save({"inner": {"model": {f"layer{i}.w": block for i in range(24)}}}, tmp_path / "shared.pt")
    assert len(load_torch_file(tmp_path / "shared.pt")["inner"]["model"]) == 24
    torch.save({"inner": [block] * 20_000}, tmp_path / "listed.pt")
    with pytest.raises(ValueError, match="listed a great many times"):
        load_torch_file(tmp_path / "listed.pt")
    nested = [torch.zeros(1)]  # a list holding itself twice, 40 times over: a 2 KB file, 2**40 tensors to walk
    for _ in range(40):
        nested = [nested, nested]
    torch.save({"inner": nested}, tmp_path / "nested.pt")
    with pytest.raises(ValueError, match="listed a great many times"):
        load_torch_file(tmp_path / "nested.pt")
    betas = (0.9, 0.95)  # (but one tuple shared by two param groups, as pickle shares it, is honest)
    torch.save({"inner": {"optimizer": {"param_groups": [{"betas": betas}, {"betas": betas}]}}}, tmp_path / "g.pt")
    assert load_torch_file(tmp_path / "g.pt")["inner"]["optimizer"]["param_groups"][1]["betas"] == betas
    state = torch.load(save(10), weights_only=True)
    n = state["tensors"]["global_params"].numel()
    state["tensors"]["global_params"] = state["tensors"]["global_params"].reshape(n, 1)
    state[DIGEST_KEY] = checkpoint_digest(state)  # made up whole: its digest matches
    torch.save(state, p.state_dir / "checkpoint-00000010.pt")
    assert p.load_checkpoint()["round"] == 8


def test_a_checkpoint_written_anew_where_a_damaged_one_was_counts_again(tmp_path, corpus):
    # Resumed past a damaged 9, the run came back to round 9 (a coordinator restarted from an
    # older state, say) and wrote a good 9: the pruner still took it for the damaged one and
    # deleted it, keeping the older 8 in its place.
    p, save = _keeping_two(tmp_path, corpus)

    save(8)
    state = torch.load(save(9), weights_only=True)
    state["tensors"]["global_params"][0] += 1.0  # its digest no longer matches
    torch.save(state, p.state_dir / "checkpoint-00000009.pt")
    assert p.load_checkpoint()["round"] == 8
    save(9)
    save(10)
    assert sorted(f.name for f in p.state_dir.glob("checkpoint-*.pt")) == ["checkpoint-00000009.pt",
                                                                           "checkpoint-00000010.pt"]


def test_a_checkpoint_that_could_not_be_read_is_kept_but_not_counted(tmp_path, corpus, monkeypatch):
    # A read error (EIO, EACCES) is no proof of damage: the file stays. But it is no checkpoint
    # in hand either: counting it towards keep=2 deleted 8, the one the run resumed from.
    p, save = _keeping_two(tmp_path, corpus)

    save(8)
    unreadable = save(9)
    real_load = torch.load

    def load(path, *args, **kwargs):
        if Path(path) == unreadable:
            raise PermissionError(13, "Permission denied", str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    assert p.load_checkpoint()["round"] == 8
    save(12)
    assert sorted(f.name for f in p.state_dir.glob("checkpoint-*.pt")) == [
        "checkpoint-00000008.pt", "checkpoint-00000009.pt", "checkpoint-00000012.pt"]


@pytest.mark.parametrize("went_out", [False, True])
def test_work_pt_is_taken_back_when_every_checkpoint_is_damaged(tmp_path, corpus, went_out):
    """Found by a review: with its only checkpoint damaged, a restarted volunteer ignored work.pt,
    so it lost the error feedback it had not sent and trained its batches again (counting them
    twice). The record's work does not depend on any checkpoint."""
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import resume_and_sync
    from groundswell.peer.work_file import WorkJournal

    new_process = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = new_process()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    p.outer.round_id = 3
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone()},
                              genesis_decision(p.identity, "unit"))
    checkpoint = p.save_checkpoint()
    journal = WorkJournal(p.state_dir, True)
    token = journal.start()
    assert journal.record(3, torch.full_like(p.outer.global_params, 2.0), [b"segment"], [], {"step": 123})
    if went_out:
        p.work_token = token
        assert p._remember_contribution(3, 0)
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])  # the only checkpoint, cut short

    q = new_process()
    _offline(q)
    resumed = resume_and_sync(q, [])
    assert resumed is not None and resumed["work_only"] and resumed["inner_progress"] == {"step": 123}
    assert bool((q.outer.error == 2.0).all())
    assert [item["round"] for item in resumed["unsettled"]] == ([3] if went_out else [])
    assert q.work_token == token


def test_work_pt_of_a_contribution_contributed_json_does_not_name_is_not_taken_without_a_checkpoint(
        tmp_path, corpus):
    """The record cannot be matched (contributed.json names a later contribution): its work may have
    gone out, and is not sent again."""
    from groundswell.peer.resume import resume_and_sync
    from groundswell.peer.work_file import WorkJournal

    new_process = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = new_process()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    journal = WorkJournal(p.state_dir, True)
    journal.start()
    assert journal.record(3, torch.full_like(p.outer.global_params, 2.0), [b"segment"], [], {"step": 123})
    p.work_token = "another"
    assert p._remember_contribution(4, 0)
    q = new_process()
    _offline(q)
    assert resume_and_sync(q, []) is None
    assert bool((q.outer.error == 0).all())


def test_a_checkpoint_whose_momentum_is_not_finite_is_skipped_for_an_older_one(tmp_path, corpus):
    """Found by a review: the optimizer now refuses a state that is not finite, and a DiLoCo
    checkpoint saved with a NaN momentum (its digest intact) made the start fail with that
    ValueError instead of being skipped as damaged."""
    from groundswell.peer.participant import genesis_decision

    p = _factory(tmp_path, corpus, outer={"algorithm": "diloco", "codec": "fp32"},
                 checkpoint={"every_rounds": 1, "keep": 3})()
    p.state_dir.mkdir(parents=True, exist_ok=True)
    signed = genesis_decision(p.identity, "unit")
    for r in (8, 9):
        momentum = p.outer.momentum_buffer.clone()
        if r == 9:
            momentum[5] = float("nan")
        p.outer.round_id = r
        p._snapshot = GlobalState(r, {"global_params": p.outer.global_params.clone(), "momentum_buffer": momentum},
                                  signed)
        assert p.save_checkpoint() is not None
    assert p.load_checkpoint()["round"] == 8


def test_a_state_too_slow_to_arrive_is_said_as_the_links_doing_not_the_runs(tmp_path, corpus):
    # Found by a review: "is the run still up? Start again to retry", to a volunteer whose 8 Mbit/s
    # download could never take the run's state in the time a peer is given
    from groundswell.peer.net_errors import NetworkError
    from groundswell.peer.resume import resume_and_sync
    from groundswell.peer.state_download import StateTooSlow
    from groundswell.protocol.transport import PeerUnavailable

    p = _factory(tmp_path, corpus)()
    _offline(p)

    def fails(error):
        def sync(peers, min_round=-1):
            raise error
        return sync

    p.sync_state = fails(StateTooSlow("the run's state (102 MB) did not arrive within the 81 s ..."))
    with pytest.raises(NetworkError, match="did not arrive within the 81 s .*this link seems slower") as err:
        resume_and_sync(p, [])
    assert "is the run still up" not in str(err.value)
    p.sync_state = fails(PeerUnavailable("no peer served a verifiable state"))
    with pytest.raises(NetworkError, match="is the run still up"):
        resume_and_sync(p, [])


@pytest.mark.parametrize("inner", [{"model": 5}, {"model": None}, {"model": {}, "optimizer": [1]}, {"sampler": 3},
                                   {"sampler": {"epoch": float("inf"), "position": 0}}])
def test_a_made_up_inner_state_starts_the_inner_optimizer_afresh_not_a_traceback(tmp_path, corpus, inner):
    # Found by a review (2026-12-07): an inner state of the wrong types raised a TypeError the
    # start did not catch, and the user saw a traceback instead of one line and a fresh optimizer.
    from groundswell.peer.roles import resumed_trainer

    p = _factory(tmp_path, corpus)()
    before = p.outer.global_params.clone()
    trainer = resumed_trainer(p, {"inner": inner})
    assert trainer.step == 0
    assert torch.equal(torch.nn.utils.parameters_to_vector(p.outer.params).detach(), before)


def test_another_peers_checkpoint_gives_only_its_global_state(tmp_path, corpus):
    # Found by a review (2026-12-07): a checkpoint copied in from another peer (to spare a
    # download) was taken whole, its error feedback and local progress too, and sent by both peers.
    import shutil

    from groundswell.peer.resume import resume_and_sync

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    b = _factory(tmp_path / "b", corpus, outer={"algorithm": "sparseloco"})()
    _holding_error_at_round_3(b, 0.5)
    b.outer.params[0].data.add_(0.25)  # and local progress
    written = b.save_checkpoint({"inner": {"model": {}}}, settled=True)
    assert written is not None and "local_progress" in torch.load(written, weights_only=True)
    a = _factory(tmp_path / "a", corpus, outer={"algorithm": "sparseloco"})()
    a.state_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(written, a.state_dir / written.name)
    _offline(a)
    resumed = resume_and_sync(a, [])
    assert a.outer.round_id == 3 and torch.equal(a.outer.global_params, b.outer.global_params)
    assert bool((a.outer.error == 0).all()), "another peer's unsent work was taken"
    assert not {"local_progress", "inner", "unsettled", "settled", "work"} & set(resumed)
    assert "checkpoint-foreign" in [json.loads(line)["kind"] for line in
                                    (a.state_dir / "events.jsonl").read_text().splitlines()]
    # and our own checkpoint, written next, is taken whole again
    _holding_error_at_round_3(a, 0.75)
    a.save_checkpoint()
    assert a.load_checkpoint().get("peer") == a.identity.peer_id
