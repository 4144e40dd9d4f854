"""SparseLoCo's unsent work survives a crash: `work.pt`, written after each contribution, gives a
restart the error feedback as of that contribution, and the contributions whose outcome it did
not know are settled late against their rounds' commits, by digest."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from groundswell.compression import Payload, make_codec
from groundswell.optim import SparseLoCo, SparseLoCoConfig
from groundswell.peer.run_state import GlobalState
from groundswell.peer.stop_flag import StopFlag
from groundswell.peer.swarm_exchange import SwarmExchange
from groundswell.peer.unsettled import unsettled_item
from groundswell.peer.volunteer_loop import VolunteerLoop as _VolunteerLoop
from groundswell.peer.work_file import WorkJournal, read_work
from test_resume import _factory, _offline


def _events(tmp_path) -> list[str]:
    return [json.loads(line)["kind"] for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", ["sent", "sent-retried", "sent-counted", "sent-outcome-of-another", "never-sent",
                                  "sent-again-since", "checkpoint-newer", "never-sent-checkpoint-newer"])
def test_a_restart_takes_its_error_feedback_from_the_work_record_that_matches_what_it_sent(tmp_path, corpus, case):
    """The checkpoint (round 3) is older than the last contribution, as after most crashes: its
    error feedback (ones) holds what that contribution sent. The work record (twos) holds it
    with the contribution encoded, which is right whether or not a commit counted it, once the
    contribution is settled late."""
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import resume_and_sync

    participant = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = participant()
    p.outer.round_id = 3
    p.outer.error = torch.ones_like(p.outer.global_params)
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone()},
                              genesis_decision(p.identity, "unit"))
    assert p.save_checkpoint() is not None
    p._remember_contribution(3, 0)  # a contribution of an earlier process: before the record
    journal = WorkJournal(p.state_dir, enabled=True)
    p.work_token = journal.start()
    # round 2's contribution is still unsettled; this one decays its work once more
    assert journal.record(3, 2 * torch.ones_like(p.outer.error), [b"own"], [unsettled_item(2, [b"older"], 0)])
    if not case.startswith("never-sent"):  # then the network loop records it before sending
        p._remember_contribution(3, 1)
    if case in ("sent-retried", "sent-counted"):  # the process learned the outcome, then crashed training
        journal.outcome(True if case == "sent-counted" else None, case == "sent-retried")
    if case == "sent-outcome-of-another":  # a note left by an earlier contribution says nothing of this one
        (p.state_dir / "outcome.json").write_text('{"work": "earlier", "included": true, "retried": false}')
    if case == "sent-again-since":  # a later contribution whose record was never written
        p.work_token = "another"
        p._remember_contribution(4, 0)
    if case.endswith("checkpoint-newer"):  # written once the outcome of that contribution was known
        p.outer.error = 3 * torch.ones_like(p.outer.error)
        assert p.save_checkpoint(settled=True) is not None

    again = participant()
    _offline(again)
    resumed = resume_and_sync(again, [])
    expected = {"sent-again-since": 0, "checkpoint-newer": 3, "never-sent-checkpoint-newer": 3}.get(case, 2)
    assert bool((again.outer.error == expected).all())
    older = unsettled_item(2, [b"older"], 1)
    # the last contribution sent: presumed counted if its commit cannot be checked, unless its
    # process learned its outcome
    own = {"sent": unsettled_item(3, [b"own"], 0, presume=True),
           "sent-outcome-of-another": unsettled_item(3, [b"own"], 0, presume=True),
           "sent-retried": unsettled_item(3, [b"own"], 0, retried=True),
           "sent-counted": unsettled_item(3, [b"own"], 0, included=True)}.get(case)
    unsettled = [older, own] if own else [older] if case == "never-sent" else None
    assert resumed.get("unsettled") == unsettled
    assert ("work-restored" in _events(tmp_path)) is (unsettled is not None)
    assert ("unsent-work-dropped" in _events(tmp_path)) is (case == "sent-again-since")


def test_a_torn_or_foreign_work_record_is_ignored(tmp_path):
    (tmp_path / "work.pt").write_bytes(b"torn")
    assert read_work(tmp_path, 10) is None
    journal = WorkJournal(tmp_path, enabled=True)
    journal.start()
    assert journal.record(0, torch.zeros(10), [b"x"], [])
    assert read_work(tmp_path, 10) is not None
    assert read_work(tmp_path, 11) is None  # another model
    (tmp_path / "work.pt").unlink()
    off = WorkJournal(tmp_path, enabled=False)  # DiLoCo: no record
    assert off.start() is None and not off.record(0, torch.zeros(10), [b"x"], [])
    off.outcome(True, False)
    assert not (tmp_path / "work.pt").exists() and not (tmp_path / "outcome.json").exists()


def test_a_contribution_whose_record_was_not_written_notes_no_outcome(tmp_path, monkeypatch):
    # Found by a review: a record the disk refused left the journal's token set; that contribution
    # is never sent, but its outcome overwrote the one the record on disk (the one before) relies on.
    import json

    from groundswell.peer import work_file

    journal = WorkJournal(tmp_path, enabled=True)
    first = journal.start()
    assert journal.record(0, torch.zeros(10), [b"x"], [])
    journal.outcome(False, False)
    journal.start()
    monkeypatch.setattr(work_file, "write_work", lambda *a: False)  # a full disk
    assert not journal.record(1, torch.zeros(10), [b"y"], [])
    journal.outcome(None, False)
    assert json.loads((tmp_path / "outcome.json").read_text()) == {"work": first, "included": False,
                                                                   "retried": False}


def test_a_checkpoint_names_only_a_work_record_the_disk_took(tmp_path, monkeypatch):
    # Found by a review: the participant named a contribution's record before it was written, so
    # a checkpoint after a record the disk refused named one that does not exist; a restart then
    # took the work.pt before it (older than the checkpoint) for newer, and lost the work since.
    from groundswell.peer import work_file
    from groundswell.peer.roles import record_work
    from groundswell.peer.work_file import (
        contributed_bytes,
        contributed_marker,
        read_contributed,
        resumable_work,
    )

    (tmp_path / work_file.CONTRIBUTED_FILE).write_bytes(contributed_bytes(5, 0, "sent-before"))
    p = SimpleNamespace(outer=SimpleNamespace(error=torch.zeros(8)), work_token="sent-before", work_recorded=True)
    journal = WorkJournal(tmp_path, enabled=True)
    record_work(p, journal, 6, [b"seg6"], [], {}, b"")  # written, then never sent (the round moved on)
    assert p.work_recorded and read_work(tmp_path, 8).token == p.work_token
    written = p.work_token
    monkeypatch.setattr(work_file, "write_work", lambda *a: False)  # a full disk
    record_work(p, journal, 7, [b"seg7"], [], {}, b"")
    assert not p.work_recorded and p.work_token == written
    # a checkpoint of round 8 names `p.work_token`: the record on disk is no newer than it
    settled = contributed_marker(read_contributed(tmp_path))
    assert resumable_work(read_work(tmp_path, 8), tmp_path, settled, p.work_token) is None


def test_a_work_record_keeps_every_earlier_contribution_known_to_be_counted(tmp_path):
    # as SwarmExchange keeps them: a counted one forgotten would have its work sent a second time
    from groundswell.peer.unsettled import KEEP_UNSETTLED, unsettled_item

    journal = WorkJournal(tmp_path, enabled=True)
    journal.start()
    last = KEEP_UNSETTLED + 2  # one more of open outcome than the record lists
    earlier = [unsettled_item(0, [b"counted"], last, included=True)] + [
        unsettled_item(r, [bytes([r])], last - r) for r in range(1, last)]
    assert journal.record(last, torch.zeros(10), [b"own"], earlier)
    kept = [(i["round"], i["included"]) for i in read_work(tmp_path, 10).earlier]
    assert kept == [(0, True)] + [(r, None) for r in range(last - KEEP_UNSETTLED, last)]


@pytest.mark.parametrize("found", [True, False])
def test_restored_contributions_are_settled_late_and_a_counted_one_leaves_the_error_feedback(found):
    """The crashed process's contributions: round 3's (the newest), round 2's (one contribution
    prepared after it) and a retried attempt of round 3. Round 2's commit counted ours, round 3's
    did not. When no commit can be found or checked (`found` False: the swarm moved on while we
    were down), the last contribution the crashed process sent, whose outcome it never learned,
    is taken as counted (at worst its sent part is lost; kept, it would be sent twice); the
    others stay ours, as they would in the live process."""
    n = 8192
    outer = SparseLoCo([torch.nn.Parameter(torch.zeros(n))], make_codec("sparseloco"),
                       SparseLoCoConfig(error_decay=0.5, eager=False))
    own, older, retried = (outer.encode(torch.randn(n)) for _ in range(3))
    as_bytes = [[x.to_bytes() for x in c] for c in (own, older, retried)]
    outer.round_id = 5  # the swarm's state the restart synced to
    outer.error = 2 * torch.ones(n)

    async def counts_ours(decision, segments):
        return segments == as_bytes[1]

    node = SimpleNamespace(book=SimpleNamespace(committed={r: (b"s", SimpleNamespace(round=r)) for r in (2, 3)}
                                                if found else {}),
                           client=SimpleNamespace(counts_ours=counts_ours, ask_decision=None,
                                                  own_scaled={r: () for r in range(6)}),  # fetched, not clipped
                           identity=SimpleNamespace(peer_id="me"), holders=lambda r: [],
                           options=SimpleNamespace(coordinator=""),
                           # (records read, ours alone: nobody left holds rounds 2 and 3)
                           cached_records={"me": SimpleNamespace(round=5, params_hash="", earlier_hashes=[])})
    exchange = SwarmExchange(node)  # type: ignore[arg-type]
    exchange.restore_unsettled([unsettled_item(2, as_bytes[1], 1), unsettled_item(3, as_bytes[2], 2, retried=True),
                                unsettled_item(3, as_bytes[0], 0, presume=True)])
    events: list[str] = []
    p = SimpleNamespace(outer=outer, identity=SimpleNamespace(peer_id="me"),
                        node=SimpleNamespace(call=lambda coro, timeout_s: asyncio.run(coro),
                                             interrupt_calls_on=lambda stop: None),
                        events=SimpleNamespace(write=lambda kind, **kw: events.append(kind)))
    _VolunteerLoop(p, exchange, None, [], StopFlag(), None).settle_late()  # type: ignore[arg-type]
    if found:
        assert torch.allclose(outer.error, 2 - 0.5 * outer.decode(older))
        assert events == ["included-late"]
    else:
        assert torch.allclose(outer.error, 2 - outer.decode(own))
        assert events == ["outcome-unknown", "outcome-unknown", "presumed-counted"]


def test_every_restored_contribution_is_settled_even_past_the_few_a_live_process_keeps():
    """A record lists its own contribution besides the (up to) 4 unsettled ones before it, even
    when the crashed process learned the own one's outcome: all 5 are settled after the restart,
    the oldest too (forgotten, its work would stay ours and be sent twice if its commit counted it)."""
    n = 8192
    outer = SparseLoCo([torch.nn.Parameter(torch.zeros(n))], make_codec("sparseloco"),
                       SparseLoCoConfig(error_decay=0.5, eager=False))
    sent = [[x.to_bytes() for x in outer.encode(torch.randn(n))] for _ in range(5)]
    outer.round_id = 9

    async def counts_ours(decision, segments):
        return segments == sent[0]  # the oldest one's commit counted it

    node = SimpleNamespace(book=SimpleNamespace(committed={r: (b"s", SimpleNamespace(round=r)) for r in range(1, 6)}),
                           client=SimpleNamespace(counts_ours=counts_ours, ask_decision=None,
                                                  own_scaled={r: () for r in range(6)}),  # fetched, not clipped
                           identity=SimpleNamespace(peer_id="me"), holders=lambda r: [],
                           options=SimpleNamespace(coordinator=""), cached_records={})
    exchange = SwarmExchange(node)  # type: ignore[arg-type]
    exchange.restore_unsettled([*(unsettled_item(r, sent[r - 1], 5 - r) for r in range(1, 5)),
                                unsettled_item(5, sent[4], 0, included=False)])
    events: list[tuple[str, int]] = []
    p = SimpleNamespace(outer=outer, identity=SimpleNamespace(peer_id="me"),
                        node=SimpleNamespace(call=lambda coro, timeout_s: asyncio.run(coro),
                                             interrupt_calls_on=lambda stop: None),
                        events=SimpleNamespace(write=lambda kind, **kw: events.append((kind, kw["round"]))))
    _VolunteerLoop(p, exchange, None, [], StopFlag(), None).settle_late()  # type: ignore[arg-type]
    assert events == [("included-late", 1)]
    assert torch.allclose(outer.error, -(0.5 ** 4) * outer.decode([Payload.from_bytes(b) for b in sent[0]]))
    assert exchange.unsettled == []


def test_a_commit_of_a_retried_attempt_adopted_later_takes_that_contribution_out_of_the_work():
    """Attempt 0 of round 0 was decided "retry", yet its commit (counting our first contribution)
    is what the round applied, adopted by attempt 1, to which we had sent our second. Once settled,
    the error feedback must be what it would be had the first counted on time, with the second
    round's training whole in it."""
    from groundswell.optim import RoundResult
    from test_late_outcome import _Node

    n = 8192
    steps = [torch.randn(n), torch.randn(n)]  # the two rounds' local training

    def optimizer():
        model = torch.nn.Parameter(torch.zeros(n))
        return model, SparseLoCo([model], make_codec("sparseloco"), SparseLoCoConfig(error_decay=0.5, eager=False))

    def result(mean, included):
        return RoundResult(round_id=0, mean=mean, contributors=("me",), included=included, bytes_sent=0,
                           bytes_received=0)

    on_time_model, on_time = optimizer()  # the reference: the first contribution counted on time
    with torch.no_grad():
        on_time_model.add_(steps[0])
    counted = on_time.prepare()
    on_time.apply(result(on_time.decode(counted), True))
    with torch.no_grad():
        on_time_model.add_(steps[1])
    on_time.prepare()

    model, outer = optimizer()  # retried, then adopted
    with torch.no_grad():
        model.add_(steps[0])
    first = outer.prepare()
    outer.apply(None)  # attempt 0: "retry"
    with torch.no_grad():
        model.add_(steps[1])
    outer.prepare()  # attempt 1
    outer.apply(result(outer.decode(first), False))  # the adopted commit does not count the second
    first_bytes = [x.to_bytes() for x in first]
    assert first_bytes == [x.to_bytes() for x in counted]

    async def counts_ours(decision, segments):
        return segments == first_bytes

    node = _Node(None)
    node.book = SimpleNamespace(committed={0: (b"s", SimpleNamespace(round=0))})
    node.client = SimpleNamespace(counts_ours=counts_ours, own_scaled={0: ()})  # its aggregate fetched, not clipped
    exchange = SwarmExchange(node)  # type: ignore[arg-type]
    exchange.restore_unsettled([unsettled_item(0, first_bytes, 1, retried=True)])  # as `_outcome` leaves it
    events: list[str] = []
    p = SimpleNamespace(outer=outer, identity=SimpleNamespace(peer_id="me"),
                        node=SimpleNamespace(call=lambda coro, timeout_s: asyncio.run(coro),
                                             interrupt_calls_on=lambda stop: None),
                        events=SimpleNamespace(write=lambda kind, **kw: events.append(kind)))
    assert not torch.allclose(outer.error, on_time.error)
    _VolunteerLoop(p, exchange, None, [], StopFlag(), None).settle_late()  # type: ignore[arg-type]
    assert events == ["included-late"]
    assert torch.allclose(outer.error, on_time.error, atol=1e-6)


@pytest.mark.parametrize("contributed_after_save", [False, True])
def test_a_checkpoint_lists_the_contributions_whose_outcome_is_open_and_a_restart_settles_them(
        tmp_path, corpus, contributed_after_save):
    """A checkpoint written while a retried attempt of round 3 may still be adopted lists that
    contribution: the restart keeps the work and settles it late. A contribution sent after the
    checkpoint makes both the work and the list another process's business (dropped)."""
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import resume_and_sync, unsettled_from

    participant = _factory(tmp_path, corpus, outer={"algorithm": "diloco", "codec": "fp32"})
    p = participant()
    p.outer.round_id = 3
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone(),
                                  "momentum_buffer": p.outer.momentum_buffer.clone()},
                              genesis_decision(p.identity, "unit"))
    p._remember_contribution(3, 0)  # decided "retry"
    assert p.save_checkpoint({"unsettled": [unsettled_item(3, [b"sent"], 0, retried=True)]}, settled=True) is not None
    if contributed_after_save:
        p._remember_contribution(3, 1)

    again = participant()
    _offline(again)
    resumed = resume_and_sync(again, [])
    assert unsettled_from(resumed) == ([] if contributed_after_save else [unsettled_item(3, [b"sent"], 0, retried=True)])
    assert unsettled_from({"unsettled": [("x", 1)]}) == []  # malformed: ignored, not a crash


def test_a_restart_takes_all_restored_contributions_and_the_cap_later_keeps_the_newest():
    """The cap's worth of earlier contributions of open outcome and the last one sent: all are
    restored (to be settled at once: test_every_restored_contribution_is_settled_even_past_the_few_a_live_process_keeps);
    what is still open when the cap next applies loses the oldest, never the last one sent (the
    one most likely counted)."""
    from groundswell.peer.unsettled import KEEP_UNSETTLED

    node = SimpleNamespace(identity=SimpleNamespace(peer_id="me"))
    exchange = SwarmExchange(node)  # type: ignore[arg-type]
    last = KEEP_UNSETTLED + 1  # the cap's worth of open ones, and the last one sent
    items = [unsettled_item(r, [bytes([r])], last - r) for r in range(1, last)] + [
        unsettled_item(last, [b"own"], 0, presume=True)]
    exchange.restore_unsettled(items)
    assert [(u.round_id, u.if_unknown) for u in exchange.unsettled] == [(r, r == last) for r in range(1, last + 1)]
    exchange._keep_newest()
    assert [(u.round_id, u.if_unknown) for u in exchange.unsettled] == [(r, r == last) for r in range(2, last + 1)]
    # and a checkpoint or the next record keeps the presumption
    assert [i["presume"] for i in exchange.unsettled_work()] == [False] * (KEEP_UNSETTLED - 1) + [True]


def test_a_contribution_keeps_the_commit_its_round_was_planned_from_through_a_restart(tmp_path):
    """A restart that took a later state checks the round's commit with it (see
    tests/test_late_outcome_restart.py): the record, a checkpoint's list and the exchange carry it;
    a record of an older version, without it, still reads."""
    from groundswell.peer.unsettled import parse_unsettled

    journal = WorkJournal(tmp_path, enabled=True)
    journal.start()
    earlier = [unsettled_item(2, [b"older"], 0, basis=b"commit-1")]
    assert journal.record(3, torch.zeros(10), [b"own"], earlier, basis=b"commit-2")
    record = read_work(tmp_path, 10)
    assert record is not None and record.own["basis"] == b"commit-2" and record.earlier[0]["basis"] == b"commit-1"
    exchange = SwarmExchange(SimpleNamespace(identity=SimpleNamespace(peer_id="me"), book=None))  # type: ignore[arg-type]
    exchange.restore_unsettled([*record.earlier, record.own])
    assert [u.basis for u in exchange.unsettled] == [b"commit-1", b"commit-2"]
    assert [i["basis"] for i in exchange.unsettled_work()] == [b"commit-1", b"commit-2"]
    legacy = {k: v for k, v in unsettled_item(4, [b"x"], 0).items() if k != "basis"}
    assert parse_unsettled([legacy]) == [unsettled_item(4, [b"x"], 0)]
    exchange.restore_unsettled(parse_unsettled([legacy]))
    assert exchange.unsettled[-1].basis == b""
    with pytest.raises(ValueError):
        parse_unsettled([dict(legacy, basis="text")])


def test_a_second_restart_takes_the_checkpoint_the_first_one_wrote_after_restoring_the_record(tmp_path, corpus):
    """The record's contribution never went out. The first restart takes its error feedback,
    trains, and stops with a checkpoint before contributing: that checkpoint is newer than the
    record, and the second restart takes it."""
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import resume_and_sync

    participant = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = participant()
    p.outer.round_id = 3
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone()},
                              genesis_decision(p.identity, "unit"))
    assert p.save_checkpoint() is not None
    journal = WorkJournal(p.state_dir, enabled=True)
    p.work_token = journal.start()
    assert journal.record(3, 2 * torch.ones_like(p.outer.error), [b"own"], [])

    first = participant()
    _offline(first)
    resume_and_sync(first, [])
    assert bool((first.outer.error == 2).all())
    first.outer.error = 5 * torch.ones_like(first.outer.error)  # what it did since
    first._snapshot = GlobalState(3, {"global_params": first.outer.global_params.clone()},
                                  genesis_decision(first.identity, "unit"))
    assert first.save_checkpoint(settled=True) is not None

    second = participant()
    _offline(second)
    resume_and_sync(second, [])
    assert bool((second.outer.error == 5).all())


@pytest.mark.parametrize("change", [{"included": "False"}, {"decayed": -1}, {"segments": b"xy"}, {"round": 2.0},
                                    {"retried": 1}, {"included": torch.ones(2)}, {"extra": 1}])
def test_a_malformed_list_of_unsettled_contributions_is_refused(change):
    from groundswell.peer.resume import unsettled_from
    from groundswell.peer.unsettled import parse_unsettled

    good = unsettled_item(2, [b"x"], 1)
    assert parse_unsettled([good]) == [good]
    with pytest.raises(ValueError):
        parse_unsettled([dict(good, **change)])
    assert unsettled_from({"unsettled": [dict(good, **change)]}) == []


def _flip_in_file(path, needle: bytes) -> None:
    raw = bytearray(path.read_bytes())
    at = bytes(raw).find(needle)
    assert at >= 0
    raw[at + 3] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_work_record_with_a_flipped_byte_or_no_digest_is_refused(tmp_path):
    # torch.load reads a flipped byte inside a segment as is: a restart then settled a contribution
    # that was never sent (a crash at every start, or work counted twice)
    segment = b"the segment we sent, as bytes"
    journal = WorkJournal(tmp_path, enabled=True)
    journal.start()
    assert journal.record(0, torch.zeros(10), [segment], [])
    assert read_work(tmp_path, 10).own["segments"] == [segment]
    _flip_in_file(tmp_path / "work.pt", segment)
    assert read_work(tmp_path, 10) is None  # it read back as b"the!segment ..."
    reasons: list[str] = []
    assert read_work(tmp_path, 10, reasons.append) is None
    assert len(reasons) == 1 and "digest" in reasons[0]
    journal.start()
    assert journal.record(0, torch.zeros(10), [segment], [])
    state = torch.load(tmp_path / "work.pt", weights_only=True)
    del state["digest"]  # as an older version wrote it, or a damaged key name reads
    torch.save(state, tmp_path / "work.pt")
    assert read_work(tmp_path, 10) is None


def test_a_damaged_work_record_is_reported_and_never_sends_work_twice(tmp_path, corpus):
    """The record of a contribution that went out is damaged: the restart reports it and falls
    back on the checkpoint, whose work the contribution sent part of (so it is dropped)."""
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import resume_and_sync

    participant = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = participant()
    p.outer.round_id = 3
    p.outer.error = torch.ones_like(p.outer.global_params)
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone()},
                              genesis_decision(p.identity, "unit"))
    assert p.save_checkpoint() is not None
    journal = WorkJournal(p.state_dir, enabled=True)
    p.work_token = journal.start()
    segment = b"the segment we sent, as bytes"
    assert journal.record(3, 2 * torch.ones_like(p.outer.error), [segment], [])
    p._remember_contribution(3, 0)
    _flip_in_file(p.state_dir / "work.pt", segment)

    again = participant()
    _offline(again)
    resumed = resume_and_sync(again, [])
    assert bool((again.outer.error == 0).all()) and not resumed.get("unsettled")
    assert "work-corrupt" in _events(tmp_path) and "unsent-work-dropped" in _events(tmp_path)


@pytest.mark.parametrize("text", ['{"round": 1e999, "attempt": 0}', '{"round": 7, "attempt": -1e999}',
                                  '{"round": true, "attempt": 0}', '{"round": "7", "attempt": 0}',
                                  '{"round": 7.0, "attempt": 0}'])
def test_a_contributed_marker_of_other_types_is_unreadable_not_a_crash(tmp_path, text):
    # 1e999 is inf in JSON: int() raised OverflowError out of start-up; true, "7", 7.0 were taken
    from groundswell.peer.work_file import contributed_marker, read_contributed

    (tmp_path / "contributed.json").write_text('{"round": 7, "att')  # torn by a crash
    unreadable = contributed_marker(read_contributed(tmp_path))
    (tmp_path / "contributed.json").write_text(text)
    assert contributed_marker(read_contributed(tmp_path)) == unreadable == {}


@pytest.mark.parametrize("newer", ["record", "checkpoint"])
def test_a_restart_from_the_work_record_trains_on_from_where_that_contribution_left_off(tmp_path, corpus, newer):
    """The record's error feedback holds the batches trained since the checkpoint: a restart that
    takes it must not train them again (their gradients would count twice), so the record also
    keeps where training was, and the trainer moves on to there."""
    from groundswell.peer.participant import genesis_decision
    from groundswell.peer.resume import restore_progress, resume_and_sync
    from groundswell.peer.roles import volunteer_trainer

    participant = _factory(tmp_path, corpus, outer={"algorithm": "sparseloco"})
    p = participant()
    trainer = volunteer_trainer(p)
    p.outer.round_id = 3
    p._snapshot = GlobalState(3, {"global_params": p.outer.global_params.clone()},
                              genesis_decision(p.identity, "unit"))
    assert p.save_checkpoint({"inner": trainer.state_dict()}) is not None  # at step 0
    for _ in range(5):  # H inner steps' worth of data and schedule since
        trainer.sampler.next_batch()
        trainer.scheduler.step()
    trainer.step = 5
    journal = WorkJournal(p.state_dir, enabled=True)
    p.work_token = journal.start()
    assert journal.record(3, 2 * torch.ones_like(p.outer.error), [b"own"], [], trainer.progress_state())
    p._remember_contribution(3, 0)
    if newer == "checkpoint":  # the outcome known, a checkpoint at step 5 written after the record
        p.outer.error = 3 * torch.ones_like(p.outer.error)
        assert p.save_checkpoint({"inner": trainer.state_dict()}, settled=True) is not None
    expected_batch = trainer.sampler.next_batch()

    again = participant()
    _offline(again)
    resumed = resume_and_sync(again, [])
    fresh = volunteer_trainer(again)
    fresh.load_state_dict(resumed["inner"])
    if newer == "record":
        assert restore_progress(again, fresh, resumed["inner_progress"])
        assert "progress-restored" in _events(tmp_path)
    else:
        assert "inner_progress" not in resumed  # the checkpoint is where training was
    assert fresh.step == 5 and fresh.scheduler.last_epoch == trainer.scheduler.last_epoch
    # the next step runs at the schedule's rate for step 5, not the checkpoint's (warm-up: they differ)
    assert fresh.optimizer.param_groups[0]["lr"] == trainer.scheduler.get_last_lr()[0]
    assert all(torch.equal(a, b) for a, b in zip(fresh.sampler.next_batch(), expected_batch))
    # a position from another data order (another peer's seed, say) is not taken
    other = volunteer_trainer(again)
    other.sampler.seed += 1
    assert not restore_progress(again, other, trainer.progress_state()) and other.step == 0


def test_a_contributed_marker_of_the_version_before_its_check_is_still_read(tmp_path):
    # Found by a review of the check: read as damaged, every upgraded peer dropped its unsent
    # work, and one restarted within the attempt its old process fed contributed to it again.
    import json

    from groundswell.peer.work_file import contributed_marker, read_contributed

    (tmp_path / "contributed.json").write_text(json.dumps({"round": 129, "attempt": 1, "work": "ab"}))
    assert contributed_marker(read_contributed(tmp_path)) == {129: 1}
    (tmp_path / "contributed.json").write_text(json.dumps({"round": 129, "attempt": 1, "work": "ab", "x": 1}))
    assert contributed_marker(read_contributed(tmp_path)) == {}
