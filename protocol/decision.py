"""The leader's decision of an attempt: pick a source per shard, seal them (replacing those that
refuse or stay silent by replicas), gather the whole aggregate, then commit; else retry, taking
back any commit it sealed. `RoundServer` mixes this in, after a claim has passed (`claims.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from .aggregator import BEGAN_BEFORE_START, CONTESTED, FENCED_OFF
from .envelope import seal, unseal
from .plan import RoundPlan, close_time
from .schema import Ack, Decision, ProtocolError, Seal
from .shards import REPORTING_CANDIDATES, first_members, max_members, ships_contributions
from .transport import PeerUnavailable, ShardsUnavailable

if TYPE_CHECKING:
    from .server import _Attempt

log = logging.getLogger(__name__)
WITNESSES = 8  # at most this many peers are asked to witness a commit no holder sealed
# How fast a source is assumed to build its shards' means, in bytes of the fp32 values averaged
# per second: half of the ~100 MB/s one core managed here (1.3 s for 4 x 25M values' shard).
BUILD_BYTES_PER_S = 50e6


class Decider:
    """The deciding half of the leader; needs the server's ctx, transport, book, identity, joins,
    prefetch, scoring hooks, _sources(), _digests(), _learn() and _on_seal()."""

    ctx: Any
    transport: Any
    book: Any
    identity: Any
    joins: Any
    prefetch: Any
    score: Any
    individual: Any
    scores: dict[int, dict[str, float]]
    unscored_rounds: int = 0  # rounds committed unscored, scoring being on: it failed (said in the log)
    score_threshold: float
    keep_rounds: int

    async def _decide(self, plan: RoundPlan, slot: _Attempt) -> None:
        joins = self.joins[plan.round]
        membership = self.book.membership(plan.round)
        if membership is None or self.book.decided(plan.round):
            # The swarm went on while we waited (we were frozen, say) and this book let go of the
            # round's plan: it is decided; a verdict from us now would only confuse late readers.
            log.info("round %d attempt %d: decided meanwhile; standing back", plan.round, plan.attempt)
            return
        failed: set[str] = set()
        accepted: set[str] = set()  # peers that sealed one of our commits of this attempt
        asked: set[str] = set()  # peers sent one (a late answer may still seal it)
        dropped: set[str] = set()  # contributions scoring found harmful
        screened = False
        scored: dict[tuple[int, str], bytes] | None = None  # (shard, contributor) -> digest scored, with scoring on
        # One budget for the whole decision (two gathers and their seals): each gather may take up
        # to a deadline plus two slacks, and while we decide we object to every later attempt's claim.
        # Counted from after the scoring screen, which has its own bound.
        gather_s = self.ctx.deadline_s + 2 * self.ctx.slack_s
        budget_end = float("inf")
        sealers: set[str] = set()  # the peers that sealed our latest commit (asked to confirm it)
        cap = max_members(self.ctx.max_shards)
        for _ in range(4):  # a source that will not seal is replaced by a replica holding the same shard
            if self.book.decided(plan.round):
                # A later attempt's leader adopted a commit of ours (or decided otherwise), and we
                # learned it meanwhile: a re-seal now would be a second commit of the round.
                log.warning("round %d attempt %d: decided meanwhile; standing back", plan.round, plan.attempt)
                return
            if (left := budget_end - time.monotonic()) <= 0:
                log.warning("round %d attempt %d: no whole aggregate within the decision's budget", plan.round,
                            plan.attempt)
                contributors = []
                break
            sources, complete = self._sources(plan, slot, frozenset(failed))
            # At most a round's members (the commit must stay a control message): the plan's
            # trainers first; newcomers left out are told so, and keep their work.
            kept = complete - dropped
            contributors = first_members(kept & set(plan.trainers), kept, cap)
            if len(contributors) < self.ctx.min_peers:
                break
            if not screened:  # before anything is signed: a dropped contribution is never in any commit
                screened = True
                dropped = await self._screen(plan, sources, contributors, self._digests(slot, sources, contributors))
                contributors = [c for c in contributors if c not in dropped]
                if self.score is not None:  # what each scored contribution was, shard by shard
                    scored = {(s, c): d for s, src in enumerate(sources) for c in contributors
                              if (d := slot.have[s][src].get(c)) is not None}
                if len(contributors) < self.ctx.min_peers:
                    break
                budget_end = time.monotonic() + 2 * gather_s + 4 * self.ctx.slack_s
                left = budget_end - time.monotonic()
            elif scored is not None:
                # A source replaced since (it would not seal, or froze) pins its own copies: a
                # contribution it holds in another version than the one scored (sent to one
                # aggregator harmless, to the next harmful), or one never scored, is left out.
                unscored = {c for c in contributors for s, src in enumerate(sources)
                            if slot.have[s][src].get(c) != scored.get((s, c))}
                if unscored:
                    log.warning("round %d attempt %d: %d contributions differ from the versions scored at the "
                                "replaced sources; left out", plan.round, plan.attempt, len(unscored))
                    dropped |= unscored
                    contributors = [c for c in contributors if c not in unscored]
                    if len(contributors) < self.ctx.min_peers:
                        break
            trainers = first_members(set(contributors), {p for p, (t, _) in joins.items() if t}, cap)
            # Servers of the next round: those that joined as such, and every aggregator that
            # reported in this attempt (it serves, and is alive), so a leader that lost its join
            # records (a restart) does not shrink the next round to itself; but not one whose join
            # declined to serve (its uplink found too slow, `peer/uplink_watch.py`; with every
            # server an aggregator of a small run it would keep the role for good), unless the
            # commit needs it there: a source (`_sources` avoids them) or the leader.
            # Never below three servers so: too few could not hold a shard and its replicas.
            declined = {p for p, (_, s) in joins.items() if not s} - set(sources) - {self.identity.peer_id}
            reporters = {a for held in slot.have.values() for a in held} | {self.identity.peer_id}
            offered = {p for p, (_, s) in joins.items() if s}
            if len((reporters - declined) | offered) >= 3:
                reporters -= declined
            servers = first_members(reporters, offered, cap)
            pinned = self._digests(slot, sources, contributors)
            decision = Decision(plan.round, plan.attempt, "commit", contributors, trainers, servers,
                                self.identity.peer_id, sources, plan.num_shards, time.time(), pinned)
            signed = seal(self.identity, self.ctx.run_id, decision)
            # Each shard's source and its replicas (the aggregators holding the same contributions)
            # are sealed together: the replicas keep a copy of the aggregate, and a source that froze
            # costs only a short grace once a replica has answered for its shard, then is replaced.
            holders = [[src, *sorted(a for a, ids in slot.have.get(shard, {}).items() if a != src and
                                     all(ids.get(c) == slot.have[shard][src][c] for c in contributors))]
                       for shard, src in enumerate(sources)]
            asked |= {p for h in holders for p in h}
            unsealed, contested = await self._seal_all(signed, sorted({p for h in holders for p in h}), holders,
                                                       patient_until=self._attempt_deadline(plan))
            accepted |= {p for h in holders for p in h} - unsealed
            refused = set(sources) & unsealed
            if contested:  # another leader is deciding this attempt: replacing sources would fork the round
                log.warning("round %d attempt %d is being decided by another leader; standing back", plan.round,
                            plan.attempt)
                return
            if refused:
                failed |= refused
                continue
            witnessed, witnesses_asked, contested = await self._witnesses(signed, plan, contributors, holders,
                                                                          unsealed)
            asked |= witnesses_asked
            accepted |= witnessed
            if contested:
                log.warning("round %d attempt %d is being decided by another leader; standing back", plan.round,
                            plan.attempt)
                return
            if not witnessed:
                # Sealed by nobody but us: our link may be down, and the others, who cannot reach
                # us, let a stand-in decide this attempt from the shard's replicas. A commit of
                # ours would then be a second commit of the round (a netlab run split this way).
                log.warning("round %d attempt %d: no peer but this leader sealed the commit (its aggregators "
                            "restarted, or our link is down); "
                            "retry", plan.round, plan.attempt)
                contributors = []
                break
            sealers = ({p for h in holders for p in h} - unsealed) | witnessed  # of this very commit
            # A shard no holder could provide (its source froze after sealing, say): another
            # source for it, if a replica reported it whole; the other shards keep theirs.
            if not (unheld := await self._unheld_shards(signed, max(1.0, min(gather_s, left)))):
                break
            failed |= {sources[s] for s in unheld}
        else:
            contributors = []
        if len(contributors) < self.ctx.min_peers or failed >= set(sources or [""]):
            trainers, servers = list(membership.trainers), list(membership.servers)
            decision = Decision(plan.round, plan.attempt, "retry", [], trainers, servers, self.identity.peer_id, [],
                                plan.num_shards, time.time())
            signed = seal(self.identity, self.ctx.run_id, decision)
            unvoided: set[str] = set()
            if accepted:  # take back the commits we sealed: a later claimer must not try to adopt them
                unvoided, fenced_off = await self._seal_all(signed, sorted(accepted), timeout_s=self.ctx.slack_s)
                if fenced_off:
                    # A later attempt's leader fenced this attempt off and was handed our commit:
                    # it may have adopted it. Its holders keep it; we announce nothing.
                    log.warning("round %d attempt %d: a later attempt's leader fenced our commit off, or the round "
                                "committed otherwise; standing back", plan.round, plan.attempt)
                    return
            if late := (asked - accepted - {self.identity.peer_id}) | (unvoided - {self.identity.peer_id}):
                # Those that did not answer in time may still seal (a busy or paused aggregator):
                # told too, in the background (a frozen one must not hold up the retry), they
                # refuse our commit when it lands, or drop it if it landed meanwhile.
                self._spawn(self._void_late(signed, sorted(late)))  # type: ignore[attr-defined]
            unreported = [s for s in range(plan.num_shards) if not slot.have.get(s)]
            log.info("round %d attempt %d: retry (%d of %d shards reported%s, %d contributors complete in all, "
                     "%d sources failed, %d dropped)", plan.round, plan.attempt, plan.num_shards - len(unreported),
                     plan.num_shards, "".join(f"; none from shard {s}'s " + ",".join(
                         p[-8:] for p in plan.candidates(s)[:REPORTING_CANDIDATES]) for s in unreported[:2]),
                     len(self._sources(plan, slot)[1]), len(failed), len(dropped))
        elif self.book.decided(plan.round) or not await self._confirmed(plan, signed, sealers):
            return  # a later attempt's leader fenced it off (or decided the round): it may commit it otherwise
        log.info("round %d attempt %d: %s with %d contributors", plan.round, plan.attempt, decision.status,
                 len(decision.contributors))
        await self._learn(plan, signed)

    async def _confirmed(self, plan: RoundPlan, signed: bytes, sealers: set[str]) -> bool:
        """Before announcing a commit, ask the peers that sealed it and that a later attempt's
        claim would fence (this attempt's leaders, its shards' reporting candidates) whether one
        did since. Such a claimer asks us too, but we may answer too late (a saturated link while
        we gather the aggregate): it then takes our sealed commit from them, and if it cannot
        gather it in time, commits its own attempt. False: stand back, announce nothing (that
        claimer adopts our commit or decides the round otherwise). True once one of them confirmed
        and none refused; the confirmed seal is then final (a later claimer that is handed it gives
        it the whole window to gather, not two slacks)."""
        me = self.identity.peer_id
        fenced = set(plan.leaders) | {x for s in range(plan.num_shards) for x in plan.candidates(s)[:REPORTING_CANDIDATES]}
        asked = sorted((sealers & fenced) - {me})
        if not asked:
            return True  # sealed by us alone, or by contributors a claimer does not fence: nothing to ask
        # Two slacks at most (a link busy with the gather must not make an unraced leader stand
        # back); once one confirmed, the rest get a short grace (one that froze since it sealed
        # must not cost every commit that long). One refusal is enough to stand back.
        unconfirmed, fenced_off = await self._seal_all(signed, asked, [asked], timeout_s=2 * self.ctx.slack_s,
                                                       role="sealer", confirm=True)
        if fenced_off or unconfirmed >= set(asked):
            log.warning("round %d attempt %d: commit not confirmed (%s); standing back", plan.round, plan.attempt,
                        "a later attempt's leader fenced it off" if fenced_off else f"none of {len(asked)} sealers answered")
            return False
        return True

    async def _witnesses(self, signed: bytes, plan: RoundPlan, contributors: list[str], holders: list[list[str]],
                         unsealed: set[str]) -> tuple[set[str], set[str], bool]:
        """Peers other than this leader that sealed the commit, those asked, and whether one had
        sealed another leader's decision. The shards' holders first; if none of them sealed (or
        there are none), the attempt's fellow leaders and the contributors, as witnesses.

        A commit of others' work that nobody else sealed may be one a leader cut off from everyone
        made while the others decide the attempt without it. A leader that merely lost its fellow
        servers (they died; its contributors are alive) still reaches a contributor. A commit of
        the leader's own work alone (`min_peers = 1`, everyone else gone), or by the round's only
        server, needs no witness."""
        me = self.identity.peer_id
        if set(contributors) <= {me}:
            return {me}, set(), False
        held = {p for h in holders for p in h} - {me}
        if sealed := held - unsealed:
            return sealed, set(), False
        leaders = [p for p in plan.leaders if p != me and p not in held]
        if not held and not leaders:
            # We alone lead and hold the round (round 0: the coordinator serves alone). Every
            # attempt of a round has the same servers, so no other peer can decide it either.
            return {me}, set(), False
        # A witness that seals holds nothing: it shows that we are not cut off. A fellow leader's
        # seal also stops a stand-in of this attempt (it refuses that one's seal) and is handed to
        # later claimers, so a live fellow leader gets the whole slack even once a contributor
        # sealed; then the rest get a short grace (`_seal_all`, one group each).
        trainers = [c for c in contributors if c != me and c not in held and c not in leaders]
        groups = [g for g in (leaders[:WITNESSES], trainers[:max(0, WITNESSES - len(leaders))]) if g]
        others = [p for g in groups for p in g]
        refused, contested = await self._seal_all(signed, others, groups, timeout_s=self.ctx.slack_s, role="witness")
        return set(others) - refused, set(others), contested

    async def _screen(self, plan: RoundPlan, sources: list[str], contributors: list[str], digests: list[bytes]
                      ) -> set[str]:
        """Contributors whose update alone makes the probe loss worse by more than the threshold
        (the leader fetches their signed contributions from the shards' sources to try them)."""
        if self.score is None or self.individual is None:
            return set()
        round_id = plan.round
        try:
            async with asyncio.timeout(self.ctx.deadline_s):
                scores = await self.score(round_id, await self.individual(plan, sources, contributors, digests))
        except Exception as exc:  # noqa: BLE001 - scoring is a filter: without it, commit as is (and say why)
            self.unscored_rounds += 1
            # a peer or the network failing is said in one line; anything else is a bug: its traceback
            expected = isinstance(exc, (TimeoutError, PeerUnavailable, ShardsUnavailable, ProtocolError))
            log.warning("round %d: contributions not scored (%r); %d rounds unscored so far", round_id, exc,
                        self.unscored_rounds, exc_info=not expected)
            return set()
        self.scores[round_id] = scores
        for old in [r for r in self.scores if r < round_id - self.keep_rounds]:
            del self.scores[old]
        harmful = {who for who, s in scores.items() if not s <= self.score_threshold}  # NaN is harmful too
        if harmful:
            log.warning("round %d: dropping %d contributions that made the probe loss worse", round_id, len(harmful))
        return harmful

    async def _hold_all(self, signed: bytes, timeout_s: float | None = None) -> bool:
        """Gather every shard of a commit within `timeout_s` (archived here where this peer would
        be asked for them, see `AggregateFetcher._serves_shard`); False if that fails."""
        return not await self._unheld_shards(signed, timeout_s)

    async def _void_late(self, retry: bytes, peers: list[str]) -> None:
        try:
            unvoided, _ = await self._seal_all(retry, peers, timeout_s=self.ctx.deadline_s)
        except Exception as exc:  # noqa: BLE001 - a background task must never take the node down
            log.error("taking our commit back failed: %r", exc)
            return
        if unvoided:
            log.info("could not take our commit back at %s", ", ".join(p[-8:] for p in sorted(unvoided)))

    async def _unheld_shards(self, signed: bytes, timeout_s: float | None = None) -> set[int]:
        """Gather every shard of a commit within `timeout_s` (see `_hold_all`): the shards that could
        not be had (all of them when that is not known), empty if every one is held."""
        if self.prefetch is None:
            return set()
        _, decision = unseal(signed, self.ctx.run_id, Decision)
        try:
            async with asyncio.timeout(timeout_s or self.ctx.deadline_s + 2 * self.ctx.slack_s):
                await self.prefetch(signed)
            return set()
        except ShardsUnavailable as exc:
            log.warning("could not gather the commit's aggregate (%s)", exc)
            return set(exc.shards)
        except (PeerUnavailable, ProtocolError, TimeoutError) as exc:
            log.warning("could not gather the commit's aggregate (%s)", exc)
            # those we did gather (archived as we serve them: a leader serves every shard) are not
            # failed sources: re-sourcing all of them over one slow shard cost the whole attempt
            return {s for s in range(decision.num_shards)
                    if (held := self.aggregates.get((decision.round, s))) is None or held.decision != signed}

    def _attempt_deadline(self, plan: RoundPlan) -> float:
        """The attempt's deadline (its close plus a slack), on our monotonic clock: as long as a
        frozen holder may keep a commit's seal waiting when no other peer holds its shard (see
        `_seal_all`). Not longer: contributors with a single leader stop polling it a slack
        later, and the commit still has to be confirmed and announced."""
        opened = self.book.opened_at(plan.round) or 0.0
        close = close_time(opened, plan.attempt, self.ctx.deadline_s, self.ctx.slack_s)
        return time.monotonic() + (close + self.ctx.slack_s - time.time())

    async def _seal_all(self, signed: bytes, peers: list[str], groups: list[list[str]] | None = None,
                        timeout_s: float | None = None, role: str = "aggregator",
                        confirm: bool = False, patient_until: float | None = None) -> tuple[set[str], bool]:
        """Seal every peer (a retry decision voids our commit there); returns the ones that did
        not seal, and whether one of them had sealed another leader's decision of this attempt
        (with `confirm`: the seals are asked to confirm, and the flag says one was fenced off).
        A live aggregator seals at once (it only builds its shards): one that does not answer within
        a slack plus the time to average its shards is treated as refusing, and replaced. With
        `groups` (each shard's holders), once every group has a peer that sealed (or none left to
        answer), the others get only `seal_grace` more: a frozen source then costs no slack when a
        replica answered. `patient_until` (monotonic): until then a holder is waited for however
        long its seal takes: the only holder of a shard, frozen for a few seconds, used to be
        given up after one slack, and the round retried although the holder was back well
        within the attempt's deadline (a churn run lost 70 s of one round that way)."""
        _, decision = unseal(signed, self.ctx.run_id, Decision)
        # (a compute allowance, so sized by the values averaged, as fp32, whatever the codec's bytes;
        # none where aggregates carry the signed contributions: a source averages nothing then)
        shard_bytes = 0.0 if ships_contributions(self.ctx) else \
            4 * sum(self.ctx.segment_numels) * max(1, len(decision.contributors)) / max(1, decision.num_shards)
        # A source acks once it has built the means of the shards it sources; a replica acks first
        # and builds after. So the grace after every shard has a holder that sealed includes a
        # source's build: without it, a source of a big dense shard (1.3 s for 25M values from 4
        # contributors on one core) was replaced by a replica that acked first, which as the next
        # source was replaced the same way, and the round never committed (a review).
        build_s = shard_bytes * max(Counter(decision.sources).values(), default=1) / BUILD_BYTES_PER_S
        wait = self.ctx.slack_s + build_s
        loop = asyncio.get_running_loop()

        async def one(peer: str) -> Ack:
            if peer == self.identity.peer_id:
                try:
                    return await self._on_seal(peer, Seal(signed, confirm))
                except ProtocolError as exc:  # what a remote aggregator's refusal would be: not a crash of the attempt
                    log.warning("our own aggregator refused the seal: %s", exc)
                    return Ack(False, str(exc)[:500])
            try:
                patience = 0.0 if patient_until is None else patient_until - loop.time()
                ack = await self.transport.request(peer, "seal", Seal(signed, confirm), Ack,
                                                   timeout_s=max(timeout_s or wait, patience))
                if not ack.ok:  # (one that restarted since the attempt began: expected, the round retries)
                    log.log(logging.INFO if ack.reason == BEGAN_BEFORE_START else logging.WARNING,
                            "%s %s refused the seal: %s", role, peer[-8:], ack.reason)
                return ack
            except PeerUnavailable as exc:
                log.warning("seal failed: %s", exc)
                return Ack(False, str(exc)[:500])

        tasks = {asyncio.ensure_future(one(p)): p for p in sorted(set(peers))}  # owned: cancelled below
        acks: dict[str, Ack] = {}
        pending, covered_at = set(tasks), None
        try:
            while pending:
                timeout = None if covered_at is None else \
                    max(0.0, covered_at + seal_grace(self.ctx) + build_s - loop.time())
                done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                acks.update((tasks[t], t.result()) for t in done)
                if not done:
                    break  # the grace is over: whoever has not answered is replaced
                if covered_at is None and groups and all(
                        any(p in acks and acks[p].ok for p in g) or all(p in acks for p in g) for g in groups):
                    covered_at = loop.time()  # (a shard whose holders all refused waits for nobody)
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for p in tasks.values():
            if p not in acks:
                log.warning("%s %s had not answered the seal a grace after %s sealed; going on without it", role,
                            p[-8:], "every shard had a holder that" if role == "aggregator" else "another peer")
        return {p for p in tasks.values() if not (p in acks and acks[p].ok)}, \
            any(a.reason in (FENCED_OFF if confirm else CONTESTED) for a in acks.values())


def seal_grace(ctx: Any) -> float:
    """How long a seal still waits for the rest once every shard has a holder that sealed."""
    return max(1.0, ctx.slack_s / 4)
