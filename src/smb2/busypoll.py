"""Keeping an event loop polling its sockets instead of sleeping.

A loop with a ready callback polls with a zero timeout, so a reply that
arrives is seen at once rather than after the wakeup of a sleeping process
(on a virtual machine, most of a round trip).  The lock uses it on both
ends of a hand-off that is due (server/locks.py, lock.py), each bounded in
time: CPU spent for latency only where others are waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def poll_while(loop: asyncio.AbstractEventLoop, condition: Callable[[], bool],
               on_stop: Callable[[], None] | None = None) -> None:
    """Keep ``loop`` polling until ``condition()`` is false (checked once per
    loop iteration), then call ``on_stop``."""
    def step() -> None:
        if condition():
            loop.call_soon(step)
        elif on_stop is not None:
            on_stop()
    loop.call_soon(step)
