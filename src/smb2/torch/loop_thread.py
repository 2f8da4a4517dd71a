"""An event loop in a background thread, for callers that are not async.

A training loop is ordinary code; the smb2 client is asyncio.  ``LoopThread``
owns a uvloop loop in a daemon thread: ``run(coro)`` waits for a coroutine's
result, ``submit(coro)`` starts one and returns a ``concurrent.futures.Future``
that the caller collects later (its exception, raised by ``result()``, keeps
its original type, so an ``smb2.NotifyTimeout`` in the loop is an
``smb2.NotifyTimeout`` in the training thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

from ..errors import InterfaceError

T = TypeVar("T")


class LoopThread:
    """A daemon thread running one event loop until :meth:`stop`."""

    def __init__(self, name: str = "smb2-loop") -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` in the loop; its future holds the result or error."""
        if not self.running:
            coro.close()
            raise InterfaceError("the background event loop is stopped", hint="the optimizer was closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` in the loop and wait for its result (or error)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def stop(self) -> None:
        """Stop the loop (after cancelling what still runs) and join the thread."""
        if not self.running:
            return

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_rest(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
