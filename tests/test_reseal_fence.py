"""A later attempt's leader that adopts an earlier attempt's commit fences that attempt off first,
so the earlier leader can neither re-seal it otherwise nor take it back (found by a review of the
consensus code, 2026-12-05: both made two commits of one round, with no partition).

The scene, on four real nodes: L0, attempt 0's leader, seals commit C at every holder, then its
gather stalls (a saturated link); K, a leader of attempt 1 only, claims, and L0's own answer to
the claim comes too late (dropped here). K takes C. Then L0's gather finds a shard unheld: it
either re-sources that shard and seals C2 ("reseal"), or, every source failed, decides retry and
takes C back ("retry"). Before, K adopted C in its claim's first step, which fences nobody (C came
from a holder that also leads attempt 0, or from K's own seal), so L0 announced C2 beside K's C,
or dropped C's copies at every holder while K applied C."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytestmark = [pytest.mark.timeout(300)]


def _scene():
    from groundswell.protocol.plan import make_plan
    from swarm_harness import Cluster

    for _ in range(8):  # roles are drawn from the ids: K must lead attempt 1 and not attempt 0
        c = Cluster(n=4, codec_name="fp32", min_peers=2, deadline_s=31.0, slack_s=1.0)
        try:
            plans = [make_plan(c.ctx.run_id, 0, a, c.ids, c.ids, len(c.ctx.segment_numels), c.max_shards)
                     for a in (0, 1)]
        except BaseException:
            c.close()
            raise
        ks = [c.ids.index(p) for p in plans[1].leaders if p not in plans[0].leaders]
        if ks:
            return c, plans, c.ids.index(plans[0].leaders[0]), ks[0]
        c.close()
    pytest.skip("no draw of ids gave attempt 1 a leader outside attempt 0's")


@pytest.mark.parametrize("then", ["reseal", "retry"])
def test_an_adopted_commit_is_neither_resealed_otherwise_nor_taken_back(then):
    from swarm_harness import inputs

    c, (plan0, plan1), l0, k = _scene()
    try:
        s0, sk = c.nodes[l0].server, c.nodes[k].server
        unheld = {(plan0.order.index(c.ids[k]) + 2) % plan0.num_shards} if then == "reseal" \
            else set(range(plan0.num_shards))
        idle = next(i for i in range(4) if i not in (l0, k))
        xs = inputs(4, c.numel, 11)
        for i in range(4):  # every node in attempt 0 (three contribute)
            c.nodes[i].submit(c.nodes[i].client.run_attempt(0, 0, None if i == idle else c.segments(xs[i]),
                                                            trains=True, serves=True))
        deadline = time.monotonic() + 30
        while len(s0._sources(plan0, s0.attempts[(0, 0)])[1]) < 3:
            assert time.monotonic() < deadline, "the contributions never reached the aggregators"
            time.sleep(0.1)
        gathering: list[bytes] = []
        wake: list[asyncio.Event] = []

        async def install() -> None:
            wake.append(asyncio.Event())
            real = s0._unheld_shards

            async def gather(signed, timeout_s=None):
                gathering.append(signed)
                if len(gathering) == 1:  # the first gather stalls, then finds shards unheld
                    await wake[0].wait()
                    return set(unheld)
                return await real(signed, timeout_s)

            s0._unheld_shards = gather

        c.nodes[l0].call(install(), timeout_s=10)
        deciding = c.nodes[l0].submit(s0.decide_exclusively(plan0, s0.attempts[(0, 0)]))
        deadline = time.monotonic() + 30
        while not gathering:
            assert time.monotonic() < deadline, "L0 never sealed a commit"
            time.sleep(0.05)
        first = gathering[0]

        async def deaf_to_l0() -> None:  # L0's answer to the claim comes too late
            real_ask = sk._ask_claim

            async def ask(peer, plan, fence=False):
                return None if peer == c.ids[l0] else await real_ask(peer, plan, fence)

            sk._ask_claim = ask

        c.nodes[k].call(deaf_to_l0(), timeout_s=10)
        passed = c.nodes[k].call(sk._claim(plan1, sk.attempts[(0, 1)]), timeout_s=60)
        assert not passed and sk.book.committed.get(0, (None,))[0] == first, "K did not adopt L0's commit"
        c.nodes[l0]._loop.call_soon_threadsafe(wake[0].set)
        deciding.result(timeout=90)  # (the contributors' attempts are not waited for: closing ends them)
        announced = s0.attempts[(0, 0)].decision
        assert announced in (None, first), f"L0 announced another decision of round 0 after K adopted its commit ({then})"
        books = {i: n.book.committed[0][0] for i, n in enumerate(c.nodes) if 0 in n.book.committed}
        assert set(books.values()) <= {first}, "two commits of round 0"
        held = {s for n in c.nodes for (r, s), agg in n.server.aggregates.items() if r == 0 and agg.decision == first}
        assert held == set(range(plan0.num_shards)), f"shards of the adopted commit held nowhere: {held}"
        means = [c.fetch(i, first) for i in range(4)]  # every peer gets the adopted commit's one mean
        assert all(torch.equal(m, means[0]) for m in means)
    finally:
        c.close()
