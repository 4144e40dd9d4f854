"""Which NAT'ed peers a volunteer's punch scheduler tries first (peer/punch_scheduler.py)."""

from __future__ import annotations

import asyncio
import random

from groundswell.peer.dht_rejoin import DhtRejoiner
from groundswell.peer.punch_scheduler import PunchScheduler
from groundswell.protocol.schema import PeerRecord

ME = "12D3KooWM"


def _private() -> PeerRecord:
    return PeerRecord(0, "", "volunteer", True, False, [], "private", 0.0, 0, 0.0)


class _NoConnections:
    async def list_peers(self) -> list:
        return []


class _Started:
    """Stands for the scheduler's TaskGroup: notes whom each attempt is for, runs none."""

    def __init__(self) -> None:
        self.peers: list[str] = []

    def create_task(self, coro) -> None:
        self.peers.append(coro.cr_frame.f_locals["peer"])
        coro.close()


def test_proven_peers_are_punched_to_first_and_sybil_records_get_two_slots_in_random_order():
    # 100 records with ids sorting just above ours took all 4 slots, every pass, in id order:
    # an honest peer above them never got a punch (found by a review)
    records = {f"{ME}{i:04d}": _private() for i in range(100)}
    records["12D3KooWz-proven"] = records["12D3KooWz-honest"] = _private()
    rejoiner = DhtRejoiner(ME, [])
    rejoiner.vouch(["12D3KooWz-proven"])  # named in a commit we hold
    sched = PunchScheduler(ME, ["rdv"], _NoConnections(), None, lambda: records)
    sched.proven = rejoiner.is_proven
    sched.rng = random.Random(7)
    started = _Started()

    asyncio.run(sched.start_due(started))
    assert started.peers[0] == "12D3KooWz-proven" and len(started.peers) == 3  # 1 proven + 2 others
    asyncio.run(sched.start_due(started))
    assert len(started.peers) == 3  # slots for unproven peers full: the fourth stays free for proven ones
    honest_at = None
    for n in range(200):  # each pass with every slot freed (attempts ended)
        sched._trying.clear()
        started.peers.clear()
        asyncio.run(sched.start_due(started))
        assert len(started.peers) == 3 and started.peers[0] == "12D3KooWz-proven"
        if "12D3KooWz-honest" in started.peers:
            honest_at = n
            break
    assert honest_at is not None  # the others are tried in random order: the honest one's turn comes


def test_a_hung_daemon_skips_a_pass_and_does_not_stop_the_scheduler(monkeypatch):
    # `list_peers` had no bound here (it has one everywhere else): a daemon that never answered
    # it stopped every later pass for good (found by a review)
    from groundswell.peer import holepunch

    monkeypatch.setattr(holepunch, "DIAL_TIMEOUT_S", 0.2)

    class _Hung:
        calls = 0

        async def list_peers(self) -> list:
            _Hung.calls += 1
            if _Hung.calls == 1:
                await asyncio.sleep(3600)
            return []

    sched = PunchScheduler(ME, ["rdv"], _Hung(), None, lambda: {})

    async def main() -> None:
        async with asyncio.timeout(5):
            task = asyncio.ensure_future(sched.run(every_s=0.05))
            while _Hung.calls < 3:
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert _Hung.calls >= 3


def test_a_failed_pairs_backoff_outlives_a_records_read_without_its_peer(monkeypatch):
    # Found by a review (2026-12-07): the backoff was dropped whenever the peer was missing from
    # one read of the records (a record lives 6 s; a lookup that found nothing read as none), so
    # a failed pair was punched again at the very next pass, not after 150 s to 30 min.
    from groundswell.peer import holepunch

    tries: list[str] = []

    async def failing_punch(p2p, transport, rdv, target, scopes=None):
        tries.append(target)
        raise holepunch.DialFailed("dialling timed out (a symmetric NAT?)")

    monkeypatch.setattr(holepunch, "punch_through", failing_punch)
    view = {f"{ME}-nat": _private()}
    sched = PunchScheduler(ME, ["rdv"], _NoConnections(), None, lambda: view)
    asyncio.run(sched.once())
    assert tries == [f"{ME}-nat"]
    asyncio.run(sched.once())
    assert len(tries) == 1  # backed off
    view.clear()  # one read without its record
    asyncio.run(sched.once())
    view[f"{ME}-nat"] = _private()
    asyncio.run(sched.once())
    assert len(tries) == 1 and sched._fails[f"{ME}-nat"] == 1


def test_backoffs_are_forgotten_once_long_past_and_their_number_is_bounded(monkeypatch):
    import time

    sched = PunchScheduler(ME, ["rdv"], _NoConnections(), None, lambda: {})
    monkeypatch.setattr(PunchScheduler, "MAX_PAIRS", 10)
    now = time.monotonic()
    sched._next = {f"p{i:02d}": now + i for i in range(20)}
    sched._fails = {f"p{i:02d}": 1 for i in range(20)}
    sched._next["old"], sched._fails["old"] = now - PunchScheduler.MAX_RETRY_S - 1, 3
    asyncio.run(sched.once())
    assert sorted(sched._next) == [f"p{i:02d}" for i in range(10, 20)] == sorted(sched._fails)
