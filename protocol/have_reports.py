"""An aggregator's reports to an attempt's leaders: which contributors' whole shard it holds.

One report task per leader at a time, only what changed since that leader's last ok, and
everything again one slack before the attempt closes. A leader that answers it is behind (it is
catching up and cannot place the round yet) is told again every `RETRY_S` while the attempt is
open: it decides on what it was told, and nothing else would tell it before the refresh.
`Aggregator` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .plan import close_time
from .schema import MAX_LIST, Ack, HaveReport, ProtocolError
from .shards import first_members
from .transport import PeerUnavailable

log = logging.getLogger(__name__)
RETRY_S = 1.0  # the most a leader that is behind waits to hear a report again (half a slack if less)
RETRY_MIN_S = 0.25  # ... and the least (a tiny slack must not make the retries a flood)
BEHIND = "behind: this attempt cannot be placed here yet"  # a leader's answer that asks for the report again


class HaveReporter:
    """Have reports; needs the server's ctx, transport, book, identity, attempts, plan(), _spawn()
    and _on_have()."""

    ctx: Any
    transport: Any
    book: Any
    identity: Any
    attempts: Any

    async def _refresh_have(self, round_id: int, attempt: int) -> None:
        """Send our reports again one slack before the attempt closes: a leader that restarted
        since (its memory gone) or missed a report then still decides on everything we hold."""
        opened = self.book.opened_at(round_id)
        if opened is None:
            return
        at = close_time(opened, attempt, self.ctx.deadline_s, self.ctx.slack_s) - self.ctx.slack_s
        await asyncio.sleep(max(0.0, at - time.time()))
        slot = self.attempts.get((round_id, attempt))
        if slot is None or slot.sealed is not None or slot.decision is not None or self.book.decided(round_id):
            return
        slot.report_all = True
        self._report(round_id, attempt)

    def _report(self, round_id: int, attempt: int) -> None:
        """Report what we hold to the attempt's leaders. Each leader has one report task at a time
        (a burst of contributions must not open a stream per contribution to every leader: the
        leaders' stream limits would refuse them and strike us); changes meanwhile are sent next.
        A leader hears of a shard again only when what we hold of it changed (a leader's view of
        an aggregator only grows), or at the refresh, which repeats everything. One task per
        leader: a frozen fellow leader (its answers time out after a slack) must not hold back
        the reports the live one decides on."""
        slot = self.attempts[(round_id, attempt)]
        if slot.report_pending:
            return  # a launch waiting on the plan will see this change
        slot.report_pending = True
        self._spawn(self._launch_reports(round_id, attempt))

    async def _launch_reports(self, round_id: int, attempt: int) -> None:
        slot = self.attempts[(round_id, attempt)]
        try:
            plan = await self.plan(round_id, attempt, self.ctx.deadline_s)
        except Exception as exc:  # a background task must never take the node down
            log.error("have report for round %d failed: %r", round_id, exc, exc_info=exc)
            plan = None
        finally:
            slot.report_pending = False  # later changes launch again; the tasks below read holdings when they send
        if plan is None:
            return
        everything, slot.report_all = slot.report_all, False
        for leader in plan.leaders:
            if everything:
                slot.report_everything.add(leader)
            if leader in slot.reporting:
                slot.report_again.add(leader)
            else:
                slot.reporting.add(leader)
                self._spawn(self._report_to(round_id, attempt, plan, leader))

    async def _report_to(self, round_id: int, attempt: int, plan: Any, leader: str) -> None:
        slot = self.attempts[(round_id, attempt)]
        try:
            while True:
                slot.report_again.discard(leader)
                everything = leader in slot.report_everything
                slot.report_everything.discard(leader)
                if not await self._send_have(round_id, attempt, plan, leader, everything) and self._may_retry(plan):
                    retry_at = time.monotonic() + max(RETRY_MIN_S, min(RETRY_S, self.ctx.slack_s / 2))
                    while time.monotonic() < retry_at and leader not in slot.report_again:
                        await asyncio.sleep(0.1)  # a change meanwhile is sent at once, as ever
                    if self._may_retry(plan):
                        continue  # what it could not take is not in `told`: it is sent again
                if leader not in slot.report_again:
                    break
        except ProtocolError as exc:  # e.g. a conflicting decision: this report is moot; say so
            log.warning("have report for round %d not sent: %s", round_id, exc)
        except Exception as exc:  # a background task must never take the node down
            log.error("have report for round %d failed: %r", round_id, exc, exc_info=exc)
        finally:
            slot.reporting.discard(leader)

    def _may_retry(self, plan: Any) -> bool:
        """Is the plan's attempt still open to reports: undecided here and, for all we know,
        at every leader (the last stand-in decides a slack per leader after the close)?"""
        slot = self.attempts.get((plan.round, plan.attempt))
        opened = self.book.opened_at(plan.round)
        if slot is None or slot.sealed is not None or slot.decision is not None or self.book.decided(plan.round) \
                or opened is None:
            return False
        last = close_time(opened, plan.attempt, self.ctx.deadline_s, self.ctx.slack_s) + \
            len(plan.leaders) * self.ctx.slack_s
        return time.time() < last

    async def _send_have(self, round_id: int, attempt: int, plan: Any, leader: str, everything: bool) -> bool:
        """Tell one leader what we hold of each shard (what changed since its last ok, or
        everything). False: the leader is behind, and may take a report later."""
        slot = self.attempts[(round_id, attempt)]
        reports = []
        for shard, held in list(slot.contributions.items()):
            if shard >= plan.num_shards:
                continue
            first, stop = plan.shard_segments[shard]
            ids = sorted(s for s, (f, segs, _, _) in held.items() if f == first and f + len(segs) == stop)
            if len(ids) > MAX_LIST:  # (a report must stay a valid message: the plan's trainers first)
                ids = first_members(set(ids) & set(plan.trainers), set(ids), MAX_LIST)
            reports.append(HaveReport(round_id, attempt, shard, ids, [held[c][3] for c in ids],
                                      # (the plan's trainers first: leaders keep only those they expect,
                                      # and sybils with low ids pushed an honest refused one out)
                                      first_members(slot.refused & set(plan.trainers), slot.refused, 64)))

        async def tell(report: HaveReport) -> bool:
            key = (leader, report.shard)
            content = (tuple(report.contributors), tuple(report.refused))
            if not everything and slot.told.get(key) == content:
                return True
            if leader == self.identity.peer_id:
                ack = await self._on_have(leader, report)
            else:
                try:
                    ack = await self.transport.request(leader, "have", report, Ack, timeout_s=self.ctx.slack_s)
                except PeerUnavailable as exc:
                    log.info("have report to leader failed: %s", exc)
                    return True  # told again with the next change or at the refresh
            if not ack.ok:  # not recorded there: told again (a refused refresh too: it may have lost it all)
                slot.told.pop(key, None)
                return ack.reason != BEHIND  # behind: soon; else with the next change or at the refresh
            slot.told[key] = content
            return True

        told = True
        # every report finishes (none left running unowned) before the first failure is raised
        for outcome in await asyncio.gather(*(tell(report) for report in reports), return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
            told = told and outcome
        return told
