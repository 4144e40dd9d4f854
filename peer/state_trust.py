"""Which downloaded global state a joiner takes: whom to ask first, and the checks a state must
pass before it replaces ours (hash, tensors, decision, and the swarm's published hashes).

The server is not trusted: it may be broken, or hostile. A state it sends is taken only if its
bytes are what its signed reply says, its tensors are this run's, and the other peers' published
state hashes (of the parameters and, for DiLoCo, the momentum) do not contradict it (see
`StateCheck.verify` for the rules)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from groundswell.compression import all_finite
from groundswell.protocol.envelope import unseal
from groundswell.protocol.schema import Decision, ProtocolError, StateReply
from groundswell.protocol.server import check_commit_members
from groundswell.protocol.transport import PeerUnavailable

from .records import HEARTBEAT_S
from .run_state import GlobalState, RunContext, state_hash

log = logging.getLogger(__name__)
UNCONFIRMED_LEAD = 8  # rounds a state nobody confirms may be past every other record (they lag a heartbeat)
# A coordinator record at most this many rounds behind a state is waited for, up to
# COORDINATOR_WAIT_S per sync: it lags by a heartbeat, and its word is the one sybils cannot outvote.
COORDINATOR_LAG_ROUNDS = 2
COORDINATOR_WAIT_S = 4 * HEARTBEAT_S
COORDINATOR_POLL_S = HEARTBEAT_S / 2
EARLIER_HASHES = 8  # a peer's record lists its hashes of this many rounds before its newest
COMMIT_LOOKBACK = 256  # rounds before a state whose commits in our book name who may confirm it (`_named`)


class NoNewerState(PeerUnavailable):
    """Peers answered, but none holds a state of the round asked for or later (a volunteer's own
    checkpoint may be ahead of every peer online: of a coordinator restarted from an older one)."""


class ModelMismatch(PeerUnavailable):
    """A state the coordinator vouches for (the run's own) is of a model of another size than ours:
    our configuration (most likely our dataset's vocabulary) is not the run's."""


def record_hashes(record: Any) -> dict[int, str]:
    """round -> parameter hash, as a peer's record gives them: its newest round's and the earlier
    ones it lists (an entry that is not "round:hash" is skipped). {} for no record."""
    if record is None:
        return {}
    hashes: dict[int, str] = {}
    for entry in getattr(record, "earlier_hashes", ()):
        round_text, _, digest = entry.partition(":")
        if round_text.isascii() and round_text.isdigit() and digest and len(round_text) < 16:
            hashes[int(round_text)] = digest
    if record.params_hash:
        hashes[record.round] = record.params_hash
    return hashes


def state_servers(records: dict[str, Any], me: str, bootstrap_peers: list[str], coordinator: str = "") -> list[str]:
    """Whom to ask for the state, in order: peers whose (round, hash) is the coordinator's record's,
    then the coordinator; then peers whose (round, hash) the most peers published, the newest among
    equals first (peers equal in all that in a random order); then bootstrap peers without a
    record. One peer claiming a far-off round (hostile, or alone ahead), or many sybil records
    agreeing on a made-up state, are asked after the peers the run's signer vouches for."""
    votes = Counter((r.round, r.params_hash) for pid, r in records.items() if pid != me and r.params_hash)
    vouched = set(record_hashes(records.get(coordinator) if coordinator != me else None).items())

    def rank(p: str) -> int:
        if p == coordinator and vouched:
            return 1  # after the peers that agree with it: they spare it the load
        return 0 if (records[p].round, records[p].params_hash) in vouched else 2

    def key(p: str) -> tuple:
        r, group = records[p], rank(p)
        newest_vouched = -r.round if group == 0 else 0  # of the states it vouches for, the newest first
        return group, newest_vouched, -votes[(r.round, r.params_hash)], -r.round

    # Equals in a random order (the sort is stable), not by peer id: ids cost a key generation
    # each, and a few hundred buy one that sorts first among peers copying the same record.
    others = [p for p in records if p != me]
    order = sorted(random.sample(others, len(others)), key=key)
    return order + [p for p in bootstrap_peers if p not in records and p != me]


@dataclass(frozen=True)
class StateCheck:
    """What a state must be to be taken by this peer of this run."""

    ctx: RunContext
    me: str
    coordinator: str  # the coordinator's peer id: its state is taken unconfirmed
    numel: int  # parameters of the model
    needs_momentum: bool  # DiLoCo: the state must carry the outer momentum buffer
    # The coordinator's own check in an open run: only peers its verified commits name vote, and
    # one of them must confirm the state (see `vouchers_of`). None: every authorized peer votes.
    vouchers: frozenset[str] | None = None
    # The commit of a round our book already holds (signed bytes and decision), None if it holds
    # none: a state whose decision conflicts with it would not go into the book.
    known_commit: Callable[[int], tuple[bytes, Decision] | None] = field(default=lambda _round: None, compare=False)
    # When waiting for a lagging coordinator record ends (monotonic), shared by every state this
    # check sees: one sync waits for it COORDINATOR_WAIT_S at most, however many servers it asks.
    _wait_until: list[float] = field(default_factory=list, compare=False, repr=False)

    def vote_counts(self, peer: str, server: str) -> bool:
        """Does `peer`'s published hash count when checking a state `server` sent us?"""
        if peer in (server, self.me) or (self.vouchers is not None and peer not in self.vouchers):
            return False
        return peer == self.coordinator or self.ctx.authorized(peer)

    async def verify(self, reply: StateReply, blob: bytes | bytearray | memoryview, digest: str, server: str,
                     records: Callable[[], Awaitable[dict[str, Any]]]) -> GlobalState:
        """Check a downloaded state (`digest`: BLAKE3 of `blob`, hashed as it arrived over the
        stream; over the direct path the signed one, the blob having opened under that reply's
        key) and return it; raise `ProtocolError` if it must not be taken. `records`: the swarm's
        published peer records, read fresh."""
        if digest != reply.digest:
            raise ProtocolError("state failed its hash check")
        tensors = GlobalState.tensors_from_blob(blob)
        allowed = {"global_params", "momentum_buffer"}
        if "global_params" not in tensors or set(tensors) - allowed:
            raise ProtocolError(f"state holds tensors {sorted(tensors)}, expected global_params (+ momentum_buffer)")
        for name, t in tensors.items():
            if t.dtype == torch.float32 and t.dim() == 1 and t.numel() != self.numel \
                    and await self._vouched_whole(reply, tensors, server, records):
                # the run's own state, the coordinator says: ours is a model built for another
                # vocabulary (our --data is not the run's dataset)
                raise ProtocolError(f"the run's model has {t.numel()} parameters, ours {self.numel}: is our "
                                    "dataset (its vocabulary) the run's?", reason="other-model", strike=False)
            if t.dtype != torch.float32 or t.shape != (self.numel,) or not await asyncio.to_thread(all_finite, t):
                # (off the event loop, as the hash below: seconds for a large model, and the node
                # keeps its heartbeats and round duties meanwhile)
                raise ProtocolError(f"state tensor {name} is not {self.numel} finite fp32 values", reason="bad-payload")
        self.check_decision(reply, vouched=True)  # (a conflict with our book: below, once the hash is known)
        if self.needs_momentum != ("momentum_buffer" in tensors):
            raise ProtocolError("a DiLoCo state needs its momentum buffer" if self.needs_momentum
                                else "a SparseLoCo state has no momentum buffer")
        digest_of_state = await asyncio.to_thread(state_hash, reply.decision, tensors["global_params"],
                                                  tensors.get("momentum_buffer"))
        if digest_of_state != reply.params_hash:  # its signed reply named another hash (see `refuse_early`)
            raise ProtocolError("state's parameters (momentum, decision) do not have the hash its signed reply names",
                                reason="bad-payload")
        supersedes = self.conflicts(reply)
        if supersedes and not self.vouched(reply, server, await _records_or_none(records)):
            # After a split, the coordinator's word decides which side's commit is the run's: a
            # peer that cannot take the run's state keeps training on the other side's parameters.
            raise ProtocolError(f"state's decision of round {reply.round - 1} conflicts with the commit we hold",
                                reason="conflicting", strike=False)
        await self._check_with_swarm(reply.round, digest_of_state, server, records)
        return GlobalState(reply.round, tensors, reply.decision, _state_hash=digest_of_state, supersedes=supersedes)

    def check_decision(self, reply: StateReply, vouched: bool = False) -> None:
        """The state's decision must be what our book would take: the commit of the round before
        the state, signed by its leader (round -1's by the coordinator), not conflicting with one
        the book holds (after a split, ours may be the wrong one: not the server's fault), unless
        the coordinator `vouched` for the state (then ours is the wrong one: see `verify`)."""
        signer, decision = unseal(reply.decision, self.ctx.run_id, Decision)
        if decision.round != reply.round - 1:
            raise ProtocolError("state's decision is not of the round before it")
        if decision.status != "commit" or signer != decision.leader:
            raise ProtocolError("state's decision is not a commit signed by its leader")
        if decision.round == -1 and signer != self.coordinator:
            raise ProtocolError("a state of round 0 must carry the coordinator's genesis decision")
        if decision.round >= 0:
            # what a commit's own round's plan is not needed to check: in a closed run, an outsider
            # can sign no commit a state may carry (its leader, contributors and next roles are the
            # run's); in an open run it names at least min_peers contributors
            check_commit_members(self.ctx, signer, decision)
        if self.conflicts(reply) and not vouched:
            raise ProtocolError(f"state's decision of round {decision.round} conflicts with the commit we hold",
                                reason="conflicting", strike=False)

    def conflicts(self, reply: StateReply) -> bool:
        """Does the state's decision differ from the commit of its round our book holds?"""
        _, decision = unseal(reply.decision, self.ctx.run_id, Decision)
        known = self.known_commit(decision.round)
        return known is not None and known[0] != reply.decision and known[1] != decision

    def vouched(self, reply: StateReply, server: str, records: dict[str, Any]) -> bool:
        """Does the coordinator vouch for the state hash this signed reply names (it is the server,
        or its record publishes that hash for the round)? Then the state is the run's own."""
        if server == self.coordinator:
            return True
        return record_hashes(records.get(self.coordinator)).get(reply.round) == reply.params_hash

    async def _vouched_whole(self, reply: StateReply, tensors: dict[str, torch.Tensor], server: str,
                             records: Callable[[], Awaitable[dict[str, Any]]]) -> bool:
        """`vouched`, and the tensors that came have the hash the reply names (of whatever size)."""
        digest = await asyncio.to_thread(state_hash, reply.decision, tensors["global_params"],
                                         tensors.get("momentum_buffer"))
        if digest != reply.params_hash:
            return False
        try:
            published = await records()
        except Exception as exc:  # the DHT failing (any error of hivemind's): cannot tell, not the server's fault
            raise ProtocolError(f"its state is of another size than our model, and the swarm's published hashes "
                                f"could not be read to tell whether it is the run's: {exc!r}",
                                reason="unchecked", strike=False) from None
        return self.vouched(reply, server, published)

    def refuse_early(self, reply: StateReply, server: str, records: dict[str, Any]) -> None:
        """Raise `ProtocolError` for a state whose signed reply names a parameter hash the
        coordinator's record (in `records`, as last read) contradicts for its round: checked before
        a byte of its blob is read, so a state `verify` would refuse costs no download. Only the
        coordinator's word counts here; a majority of records read a moment ago may still change."""
        if server == self.coordinator or self.me == self.coordinator:
            return
        word = record_hashes(records.get(self.coordinator)).get(reply.round)
        if word is not None and word != reply.params_hash:
            raise ProtocolError(f"its state of round {reply.round} is not the one the coordinator published: "
                                "not downloaded", reason="disputed", strike=False)

    async def _check_with_swarm(self, round_id: int, state_hash: str, server: str,
                                records: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        # Cross-check against what other peers published for that round (the coordinator's record
        # if it has one for that round, else the majority). Neither
        # the server's word nor ours counts; in a closed run only its members' (and the
        # coordinator's) do. Records lag the rounds by a heartbeat or two, so a state nobody has
        # confirmed yet is taken if it is at most UNCONFIRMED_LEAD rounds past most records (and
        # in an open run past the coordinator's; from the coordinator, always): one peer must not
        # hand us a state of its own making for a far-off round, which would leave us stuck there. A made-up
        # state for a current round is caught later: our hashes then disagree with the swarm's
        # and we re-sync.
        if server == self.coordinator and self.me != self.coordinator:
            return  # the run's signer serving its own state: its word (a majority could be sybils)
        try:
            published = await records()
        except Exception as exc:  # the DHT failing (any error of hivemind's): cannot check, not the server's fault
            raise ProtocolError(f"cannot read the swarm's published hashes to check the state: {exc!r}",
                                reason="unchecked", strike=False) from None
        if not any(pid != self.me for pid in published):
            # Not one record but ours, not even the server's own: our view of the DHT is empty (its
            # lookups failed quietly, or a hostile bootstrap peer is all we reach). Nothing to check
            # against. (Our own record counted as a view: any state then passed, a review found.)
            raise ProtocolError("no peer's published hashes could be read to check the state against",
                                reason="unchecked", strike=False)
        if self.me != self.coordinator and not any(pid not in (self.me, server) for pid in published):
            # The server's own record alone is no view either: it never votes, and with no
            # coordinator's record every bound below was skipped, so a hostile bootstrap peer that
            # published its own record had a state of its own making taken, at any round (a
            # review, 2026-12-07). (The coordinator holds its own record to check against.)
            raise ProtocolError("no peer's published hashes but the server's own could be read to check the state "
                                "against", reason="unchecked", strike=False)
        named = self._named(round_id)  # (an open run: who may confirm a state past the coordinator's record)
        confirmed = None if named is None else lambda now: state_hash in _votes(named, now, server, round_id)[1]
        signer, published = await self._coordinator_record(round_id, published, records, confirmed)
        vouched = record_hashes(signer)
        word = vouched.get(round_id)
        if vouched and round_id < min(vouched):
            # Older than every round the coordinator still vouches for: no check is left, and a
            # state of that age, made up or not, would only put us behind the swarm for good.
            raise ProtocolError(f"state of round {round_id} is older than every round the coordinator still "
                                f"publishes a hash for ({min(vouched)}): not downloaded", reason="stale", strike=False)
        if word is not None:
            # The coordinator signed the run's manifest and its record is signed by its own key:
            # where it published this round's hash (its newest or one of the few before), that
            # decides, whatever the other records say (in an open run anyone can publish as many
            # records as they like).
            if word != state_hash:
                raise ProtocolError("state disagrees with the coordinator's published hash", strike=False)
            return
        check = self
        if self.vouchers is not None and not any(pid in self.vouchers for pid in published if pid not in (server, self.me)):
            # None of them is online (a coordinator back after a long outage): the plain rule, or
            # it could never get back into the run.
            log.warning("no peer of our verified commits is online to vouch for a state: taking the majority's word")
            check = dataclasses.replace(self, vouchers=None)
        voters, hashes = _votes(check, published, server, round_id)
        agree = hashes.count(state_hash)
        if check.vouchers is not None and not agree:
            # A voucher's record a heartbeat behind the state (the server applied the round
            # since, in quick rounds): read again, for a few heartbeats in all, until it lists it.
            published = await self._vouchers_record(check, round_id, state_hash, published, records, server)
            voters, hashes = _votes(check, published, server, round_id)
            agree = hashes.count(state_hash)
        if hashes and agree * 2 < len(hashes):
            raise ProtocolError("state disagrees with the swarm's published hash", strike=False)
        if check.vouchers is not None and not agree:
            raise ProtocolError("no peer named in the run's verified commits confirms this state", strike=False)
        rounds = sorted(r.round for r in voters)
        if not agree and rounds and round_id < rounds[len(rounds) // 2] - UNCONFIRMED_LEAD:
            # Backwards as forwards: records no older than the swarm's rounds vouch for nothing
            # this far back, and a made-up old state would leave us re-syncing to it again and again.
            raise ProtocolError(f"state of round {round_id}, which no other peer confirms, is more than "
                                f"{UNCONFIRMED_LEAD} rounds behind most peers' records ({rounds[len(rounds) // 2]})",
                                reason="stale", strike=False)
        # Forwards, in an open run, where records cost nothing, confirmations do not count where
        # the coordinator's record says where the run is: one more identity would confirm a state
        # of a made-up far-off round, and we would sit at that round for good (re-syncs ask for
        # newer states only). (A coordinator catching up after a restart holds joiners back until
        # it has: they are refused without a strike, and re-syncs try again after the next round.)
        if signer is not None and self.ctx.allowlist is None and round_id > signer.round + UNCONFIRMED_LEAD:
            # ("unconfirmed": a coordinator far behind, catching up after a restart, is no reason
            # for a volunteer restarting from its own checkpoint to give that up and quit, as one
            # did in CI when the coordinator's daemon crash left it 9 one-second rounds behind)
            raise ProtocolError(f"state of round {round_id} is more than {UNCONFIRMED_LEAD} rounds past the "
                                f"coordinator's record ({signer.round})", reason="unconfirmed", strike=False)
        if signer is not None and round_id > signer.round:
            # The live coordinator has not got there, though we waited for its record. One peer's
            # word would have us take a state of its own making (its commit, itself our next
            # leader) at every re-sync (a review); in an open run so would one more free identity's
            # record (the next review): there only peers our verified commits name confirm. An
            # honest server alone ahead costs little: others serve the round before, then its aggregate.
            who = "other peer"
            if named is not None:
                who = "peer named in our verified commits"  # (their records were waited for, as its)
                hashes = _votes(named, published, server, round_id)[1]
                if (agree := hashes.count(state_hash)) * 2 < len(hashes):
                    raise ProtocolError("state disagrees with the hashes peers named in our verified commits "
                                        "published", strike=False)
            if not agree:
                raise ProtocolError(f"state of round {round_id}, which no {who} confirms, is past the coordinator's "
                                    f"record ({signer.round})", reason="unconfirmed", strike=False)
        most = rounds[len(rounds) // 2] if rounds else None  # the swarm's round: most records', not the newest
        if not agree and most is not None and round_id > most + UNCONFIRMED_LEAD:
            raise ProtocolError(f"state of round {round_id}, which no other peer confirms, is more than "
                                f"{UNCONFIRMED_LEAD} rounds past most peers' records ({most})", strike=False)

    def _named(self, round_id: int) -> StateCheck | None:
        """In an open run, this check with our book's verified commits' contributors as its
        `vouchers` (the coordinator's own rule); None in a closed run (its members' records are
        the run's) or for the coordinator (which has its `vouchers`)."""
        if self.ctx.allowlist is not None or self.vouchers is not None or self.me == self.coordinator:
            return None
        held = {r: c for r in range(round_id - COMMIT_LOOKBACK, round_id) if (c := self.known_commit(r))}
        return dataclasses.replace(self, vouchers=vouchers_of(held))

    async def _coordinator_record(self, round_id: int, published: dict[str, Any],
                                  records: Callable[[], Awaitable[dict[str, Any]]],
                                  confirmed: Callable[[dict[str, Any]], bool] | None = None,
                                  ) -> tuple[Any, dict[str, Any]]:
        """The coordinator's record (None where it is us: our own word does not count) and the
        records read last. A record a round or two behind the state is read again
        for a few heartbeats (the server applied the round just before the coordinator published
        it): without the coordinator's word the majority decides, which sybil records can stuff.
        A coordinator further behind is not waited for (it may be catching up for a long time),
        except, given `confirmed` (an open run), up to UNCONFIRMED_LEAD rounds while that is false
        of the records: in rounds quicker than its heartbeat, its record is behind every state."""
        if self.coordinator == self.me:
            return None, published

        def behind(now: dict[str, Any]) -> bool:
            rec = now.get(self.coordinator)
            if rec is None or not rec.round < round_id <= rec.round + UNCONFIRMED_LEAD:
                return False
            return round_id <= rec.round + COORDINATOR_LAG_ROUNDS or confirmed is not None and not confirmed(now)

        published = await self._read_again_while(behind, published, records, "the coordinator's record")
        return published.get(self.coordinator), published

    async def _vouchers_record(self, check: StateCheck, round_id: int, state_hash: str, published: dict[str, Any],
                               records: Callable[[], Awaitable[dict[str, Any]]], server: str) -> dict[str, Any]:
        """The records read again while none confirms the state and a voucher's is behind its round
        by no more than a record lists (within the same few heartbeats per sync as `_coordinator_record`)."""
        def behind(now: dict[str, Any]) -> bool:  # (and the state not confirmed yet: one slow voucher holds no one up)
            return not _votes(check, now, server, round_id)[1].count(state_hash) and any(
                check.vote_counts(pid, server) and r.round < round_id <= r.round + EARLIER_HASHES
                for pid, r in now.items())

        return await self._read_again_while(behind, published, records, "the vouchers' records")

    async def _read_again_while(self, waiting: Callable[[dict[str, Any]], bool], published: dict[str, Any],
                                records: Callable[[], Awaitable[dict[str, Any]]], whose: str) -> dict[str, Any]:
        """The records, read again every poll while `waiting(them)` holds, within the few
        heartbeats (`COORDINATOR_WAIT_S`) one sync may wait in all."""
        if waiting(published) and not self._wait_until:
            self._wait_until.append(time.monotonic() + COORDINATOR_WAIT_S)
        while waiting(published) and time.monotonic() < self._wait_until[0]:
            await asyncio.sleep(COORDINATOR_POLL_S)
            try:
                published = await records()
            except Exception as exc:  # noqa: BLE001 (the DHT failing: decide on the records read before)
                log.info("re-reading %s failed: %r", whose, exc)
                break
        return published


def _votes(check: StateCheck, published: dict[str, Any], server: str, round_id: int) -> tuple[list[Any], list[str]]:
    """The records that vote on a state `server` sent, and their hashes of its round: each voter's
    newest, or one its record lists from the rounds just before (quick rounds move records past
    the state's; a listed round outside those, which no honest record lists, votes for nothing)."""
    voters = [r for pid, r in published.items() if check.vote_counts(pid, server) and r.params_hash]
    return voters, [h for r in voters if (h := _hash_of(r, round_id)) is not None]


def _hash_of(record: Any, round_id: int) -> str | None:
    """`record`'s hash of `round_id`: its newest, or one it lists of the EARLIER_HASHES rounds before."""
    if record.round == round_id:
        return record.params_hash
    return record_hashes(record).get(round_id) if record.round - EARLIER_HASHES <= round_id < record.round else None


async def _records_or_none(records: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """The swarm's records, or none if the DHT fails (then nothing is vouched for: the state is
    refused as any unchecked one is, and the next server is asked)."""
    try:
        return await records()
    except Exception as exc:  # noqa: BLE001 (the DHT failing, as in `_vouched_whole`)
        log.info("peer records could not be read: %r", exc)
        return {}


def vouchers_of(committed: dict[int, tuple[bytes, Any]]) -> frozenset[str]:
    """The peers a coordinator's verified commits name as contributors: in an open run, where
    records cost nothing to publish, the only ones whose word on a state it takes (a sybil would
    have had to do real work in a committed round to be among them)."""
    # a copy first (one C call, under the GIL): the network loop adds and prunes commits meanwhile
    return frozenset(c for _, decision in tuple(committed.values()) for c in decision.contributors)
