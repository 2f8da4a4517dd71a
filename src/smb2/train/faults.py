"""Faults in training terms.

Below the store a fault is a connection or a segment: ``connection to
127.0.0.1:7602 lost``, ``no segment 26``.  A worker's user thinks in stores,
ranks and steps, and needs to know what to do next.  :func:`in_training_terms`
rewords the faults a training job meets (a memory server lost, the store
removed under a running job) as one line naming the store, the rank, the
step and the server, with the remedy as the hint; anything else passes
unchanged.  The original message is kept in ``err.detail``, and the new
error keeps the original's type, so code that catches ``TransportError``
or ``NoSuchBuffer`` still does.

A worker that does not catch such a fault ends with it: :func:`end_ranks_briefly`
(which the torch optimizer calls) makes that end the fault's own lines on
stderr (message, DETAIL, HINT), not 20 lines of traceback repeated by every
rank; the traceback is still there for who asks (``SMB2_DEBUG=1``, or the
``smb2`` logger at DEBUG).

A fault that raises nothing is a server that stops answering (paused,
overloaded, cut off by the network without a reset): its operations wait as
long as their connection lives, and the job stalls without a word.
:class:`ExchangeWatch` keeps the worker's exchanges in flight; while the
oldest has waited :data:`SAY_SILENT_AFTER` seconds (and three times the
longest exchange before it: a slow link's exchanges are long every time,
and the servers are not asked each time) it asks each server for its
statistics, behind the exchange on the job's own connection, and names
those that give no reply within :data:`PING_TIMEOUT` s, at WARNING, every
:data:`SAY_SILENT_EVERY` s; a worker that exchanges through its host's agent
(``smb2-agent``) asks the agent too, whose pause stalls the host's workers
as a server's does.  Where every one answers, the wait is on other workers,
which the rules report themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from ..client import Client
from ..errors import NoSuchBuffer, OutOfMemory, Smb2Error, TransportError, debug_wanted
from .lifecycle import Waiting

#: an exchange in flight this long (seconds) has the servers asked whether they answer
SAY_SILENT_AFTER = 30.0
#: then, while it waits, the silent ones are named at most this often
SAY_SILENT_EVERY = 60.0
#: a server that gives no reply within this many seconds is silent
PING_TIMEOUT = 5.0

# the hook end_ranks_briefly replaced (every other exception goes to it)
_previous_hook = sys.excepthook
_installed = threading.Lock()


def in_training_terms(err: BaseException, *, store: str, rank: int, step: int) -> BaseException:
    """The error a training worker should see for ``err``."""
    if not isinstance(err, Smb2Error) or getattr(err, "in_training_terms", False):
        return err
    server = getattr(err, "server", None) or "a memory server"
    out: Smb2Error
    if isinstance(err, TransportError) and step == 0 and err.message.startswith("cannot connect"):
        # (before the first step: most often a server of the list that is not up, not one lost)
        out = type(err)(
            f"rank {rank} cannot reach memory server {server} to train store {store!r}",
            errno=err.errno, status=err.status, server=err.server, detail=err.message,
            hint="start that smb2-server, or leave it out of the job's server list (SMB2_SERVERS or servers=; "
                 "every worker lists the same ones); `smb2 doctor SERVERS` checks a list before a job")
    elif isinstance(err, TransportError):
        out = type(err)(
            f"rank {rank} lost memory server {server} at step {step} of store {store!r}",
            errno=err.errno, status=err.status, server=err.server, detail=err.message,
            hint=f"restart that smb2-server (with its --data-dir, where it saved the store if it was stopped "
                 f"cleanly, SIGTERM or SIGINT) and run the job again: it resumes store {store!r} from its last "
                 f"step; if the server's data is gone (it crashed, or keeps none), start from a "
                 "checkpoint (init_from=PATH) or over (resume=False); to train on through a lost server, give the "
                 "store replicas=2 (servers started with --membership)")
    elif isinstance(err, NoSuchBuffer):
        out = type(err)(
            f"store {store!r} is gone from memory server {server} while rank {rank} was at step {step} "
            "(removed with `smb2 rm`, made again by a job launched with another WORLD_SIZE, or the server "
            "restarted without its data)",
            server=err.server, detail=err.message,
            hint="nothing was written to another buffer; start the job again (a fresh run) or from a "
                 "checkpoint (init_from=PATH), and remove a store only when `smb2 ls` shows its run finished")
    elif isinstance(err, OutOfMemory) and step == 0:
        # (the store is made before the first step: the servers' --capacity, shared with the stores of
        # earlier runs, which stay until removed so that a run can resume)
        out = OutOfMemory(
            f"memory server {server} has no room for store {store!r} (rank {rank}, before the first step)",
            server=err.server, detail=err.message,
            hint="`smb2 ls` lists the stores the servers hold and `smb2 rm NAME` removes one whose run is over "
                 "(each keeps its memory so that its run can resume); or start the servers with a larger "
                 "--capacity, or add servers to the job's list (a store is striped over all of them)")
    else:
        return err
    setattr(out, "in_training_terms", True)     # noqa: B010 (worded once, not again by an outer layer)
    return out


class ExchangeWatch:
    """A worker's exchanges in flight, and the servers that keep the oldest
    waiting without a word (the module's doc)."""

    def __init__(self, client: Client, store: str, rank: int, agent: Client | None = None) -> None:
        self.client = client
        #: the connection to this host's agent, where the worker exchanges through one
        self.agent = agent
        self.store = store
        self.rank = rank
        #: each exchange in flight, in the order they started: the report of its wait, and its step
        self._running: dict[int, tuple[Waiting, int]] = {}
        self._count = 0
        #: the longest exchange so far (seconds): one that waits three times as long is out of the ordinary
        self._longest = 0.0
        #: each server's last request for its statistics, until it is answered (-1: the agent's)
        self._asked: dict[int, asyncio.Task[Any]] = {}

    @contextlib.contextmanager
    def running(self, step: int) -> Iterator[None]:
        """An exchange of step ``step`` runs inside."""
        key = self._count = self._count + 1
        # (a slow link's exchanges take long every time)
        self._running[key] = (Waiting(None, max(SAY_SILENT_AFTER, 3 * self._longest), SAY_SILENT_EVERY), step)
        try:
            yield
        finally:
            waiting, _ = self._running.pop(key)
            if not waiting.said:            # (one that was named is no measure of the ordinary)
                self._longest = max(self._longest, time.monotonic() - waiting.since)

    async def watch(self) -> None:
        """Look every few seconds, until cancelled."""
        while True:
            await asyncio.sleep(min(10.0, SAY_SILENT_AFTER / 3))
            if not self._running:
                continue
            oldest = min(self._running)
            waiting, step = self._running[oldest]
            if not waiting.due():
                continue
            silent = await self._silent_servers()
            if silent and oldest in self._running:
                who = f"{silent[0]} does" if len(silent) == 1 else f"{', '.join(silent)} do"
                waiting.say(f"store {self.store!r}: rank {self.rank} has waited for step {step}'s exchange: {who} "
                            f"not answer (a request for its statistics got no reply within {PING_TIMEOUT:g} s). "
                            "Paused, overloaded, or cut off by the network? The exchange goes on once it answers; "
                            "stop the job if it is gone")

    async def _silent_servers(self) -> list[str]:
        """The connected servers (and this host's agent) that give no reply
        to a request for their statistics within :data:`PING_TIMEOUT` s, as
        named to a user.  It goes on the job's own connection, with no
        deadline: a deadline would reset the connection and fail what it
        carries, and a connection of its own would count against the
        server's connection cap (where it may evict another client's).  One
        still owing the last one is not asked again."""
        names = {i: f"memory server {server}" for i, server in enumerate(self.client.servers)}
        for i, link in enumerate(self.client.links):
            if link.transport is not None and (i not in self._asked or self._asked[i].done()):
                self._asked[i] = asyncio.ensure_future(self.client.server_stat(i))
        if self.agent is not None and not self.agent.closed:
            names[-1] = f"the host agent {self.agent.servers[0]} (smb2-agent)"
            if -1 not in self._asked or self._asked[-1].done():
                self._asked[-1] = asyncio.ensure_future(self.agent.server_stat(0))
        if not self._asked:
            return []
        await asyncio.wait(self._asked.values(), timeout=PING_TIMEOUT)
        for task in self._asked.values():
            if task.done() and not task.cancelled():
                task.exception()        # (retrieved: one that failed the request answered it)
        return [names[i] for i, task in self._asked.items() if not task.done()]

    def close(self) -> None:
        for task in self._asked.values():
            task.cancel()


def end_ranks_briefly() -> None:
    """Report a fault in training terms that ends this process (uncaught)
    as its message and hint, without the traceback; idempotent."""
    global _previous_hook
    with _installed:
        if sys.excepthook is not _brief_report:
            _previous_hook = sys.excepthook
            sys.excepthook = _brief_report


def _brief_report(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
    if not getattr(err, "in_training_terms", False) or debug_wanted():
        _previous_hook(kind, err, tb)
        return
    print(f"smb2: {err}\n(the traceback: run with SMB2_DEBUG=1)", file=sys.stderr, flush=True)
