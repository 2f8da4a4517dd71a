"""Waiting for a state, not for a time: tests run on loaded machines, so a
state is polled for until it holds, and the only clock is a generous hang
guard whose running out is a failure that says what never came."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

# long enough that no scheduler delays reach it: only a state that never
# comes does
HANG_GUARD = 60.0


async def until(check: Callable[[], bool | Awaitable[bool]], what: str, *,
                guard: float = HANG_GUARD, every: float = 0.01) -> None:
    """Poll ``check`` (a function, or a coroutine function) every ``every``
    seconds until it is true; AssertionError naming ``what`` if ``guard``
    seconds pass first."""
    try:
        async with asyncio.timeout(guard):
            while True:
                done = check()
                if inspect.isawaitable(done):
                    done = await done
                if done:
                    return
                await asyncio.sleep(every)
    except TimeoutError:
        raise AssertionError(f"{what}: not reached within the {guard:g} s hang guard") from None
