"""Small asyncio helpers shared by the live stack's long-running services."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel background tasks and wait for them, swallowing their endings."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
