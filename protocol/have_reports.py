"""An aggregator's reports to an attempt's leaders: which contributors' whole shard it holds.

One report task per leader at a time, only what changed since that leader's last ok, and
everything again one slack before the attempt closes. `Aggregator` mixes this in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .plan import close_time
from .schema import Ack, HaveReport, ProtocolError
from .transport import PeerUnavailable

log = logging.getLogger(__name__)


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
                await self._send_have(round_id, attempt, plan, leader, everything)
                if leader not in slot.report_again:
                    break
        except ProtocolError as exc:  # e.g. a conflicting decision: this report is moot; say so
            log.warning("have report for round %d not sent: %s", round_id, exc)
        except Exception as exc:  # a background task must never take the node down
            log.error("have report for round %d failed: %r", round_id, exc, exc_info=exc)
        finally:
            slot.reporting.discard(leader)

    async def _send_have(self, round_id: int, attempt: int, plan: Any, leader: str, everything: bool) -> None:
        """Tell one leader what we hold of each shard (what changed since its last ok, or everything)."""
        slot = self.attempts[(round_id, attempt)]
        reports = []
        for shard, held in list(slot.contributions.items()):
            if shard >= plan.num_shards:
                continue
            first, stop = plan.shard_segments[shard]
            ids = sorted(s for s, (f, segs, _, _) in held.items() if f == first and f + len(segs) == stop)
            reports.append(HaveReport(round_id, attempt, shard, ids, [held[c][3] for c in ids],
                                      sorted(slot.refused)[:64]))

        async def tell(report: HaveReport) -> None:
            key = (leader, report.shard)
            content = (tuple(report.contributors), tuple(report.refused))
            if not everything and slot.told.get(key) == content:
                return
            if leader == self.identity.peer_id:
                if not (await self._on_have(leader, report)).ok:
                    return
            else:
                try:
                    ack = await self.transport.request(leader, "have", report, Ack, timeout_s=self.ctx.slack_s)
                except PeerUnavailable as exc:
                    log.info("have report to leader failed: %s", exc)
                    return  # told again with the next change or at the refresh
                if not ack.ok:  # e.g. it cannot plan the round yet: not recorded there
                    return
            slot.told[key] = content

        # every report finishes (none left running unowned) before the first failure is raised
        for failure in await asyncio.gather(*(tell(report) for report in reports), return_exceptions=True):
            if isinstance(failure, BaseException):
                raise failure
