"""Concurrent awaits that own their tasks (trio's nursery rule in asyncio)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def gather_owned(aws: Iterable[Awaitable[T]]) -> list[T]:
    """`asyncio.gather`, except that when one fails (or the caller is cancelled) the others are
    cancelled and awaited before the first error goes up: none runs on unowned. The error is the
    task's own (not an ExceptionGroup), so callers catch what they caught before."""
    tasks: list[asyncio.Future[T]] = []
    try:
        for a in aws:  # (inside the try: an error making the next one still ends those made)
            tasks.append(asyncio.ensure_future(a))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
