"""gather_owned: no task outlives the await that started it."""

from __future__ import annotations

import asyncio

import pytest
from groundswell.protocol.tasks import gather_owned


def test_a_failure_cancels_and_awaits_the_others_and_raises_its_own_error():
    # With asyncio.gather, the other shards of a contribution went on sending for an attempt the
    # peer had already written off, owned by nobody.
    ended: list[str] = []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append(name)  # reached before gather_owned returns: awaited, not just cancelled
        return name

    async def broken() -> str:
        await asyncio.sleep(0.01)
        raise KeyError("shard 3")

    async def main() -> None:
        with pytest.raises(KeyError, match="shard 3"):  # the task's own error, not an ExceptionGroup
            await gather_owned([slow("a"), broken(), slow("b")])
        assert sorted(ended) == ["a", "b"]
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(main())


def test_results_come_in_order_and_a_cancelled_caller_leaves_nothing_running():
    ended: list[int] = []

    async def value(i: int, wait: float) -> int:
        try:
            await asyncio.sleep(wait)
            return i
        finally:
            ended.append(i)

    async def main() -> None:
        assert await gather_owned(value(i, 0.01 * (3 - i)) for i in range(3)) == [0, 1, 2]
        ended.clear()
        caller = asyncio.ensure_future(gather_owned([value(7, 3600), value(8, 3600)]))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert sorted(ended) == [7, 8]

    asyncio.run(main())


def test_an_error_making_the_awaitables_still_ends_those_already_made():
    ended: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("slow")

    def made():
        yield slow()
        raise ValueError("no plan for shard 2")

    async def main() -> None:
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="shard 2"):
            await gather_owned(made())
        await asyncio.sleep(0)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(main())
    assert ended in ([], ["slow"])  # cancelled before or after it started: either way not left running
