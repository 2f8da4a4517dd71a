"""Where a store's shared weights are read and accumulated.

By default that is the data region of the store's own buffer on the memory
servers (:class:`ServerWeights`).  With a host agent it is the agent's
mirror of that region (:class:`AgentWeights`): the host's workers push into
one local copy and read it, and the agent forwards their combined pushes and
pulls for them all.  Everything else a store does (its control words: the
version, the barrier, heartbeats; locks; side buffers) goes to the servers
either way, so only the data path changes.

Offsets here are bytes from the start of the data region, and sparse
indices count elements of it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, Protocol

import numpy as np

from ..client import Buffer
from ..errors import AgentLost, NotifyTimeout
from ..mirror import AgentMirror

log = logging.getLogger("smb2.train.weights")

#: the longest a worker waits for its host agent to forward its last pushes (seconds):
#: an agent that cannot reach the servers for longer is reported as lost
FLUSH_TIMEOUT = 120.0


class SharedWeights(Protocol):
    """The three operations the rules and the store use on the shared weights."""

    @property
    def via(self) -> str:
        """Where they go: "servers", "agent" or "servers (agent lost)"."""

    async def read_into(self, out: np.ndarray, offset: int = 0) -> None: ...

    async def accumulate(self, offset: int, delta: np.ndarray, *, wire: str | None = None) -> None: ...

    async def accumulate_sparse(self, indices: Any, values: np.ndarray, *, wire: str | None = None) -> None: ...

    async def flushed(self) -> None:
        """Return once this worker's pushes so far are on the servers."""


class ServerWeights:
    """The data region of ``buf`` (starting at byte ``data_off``) on the memory servers."""

    via = "servers"

    def __init__(self, buf: Buffer, data_off: int) -> None:
        self.buf = buf
        self.data_off = data_off

    async def read_into(self, out: np.ndarray, offset: int = 0) -> None:
        await self.buf.read_into(out, self.data_off + offset)

    async def accumulate(self, offset: int, delta: np.ndarray, *, wire: str | None = None) -> None:
        await self.buf.accumulate(self.data_off + offset, delta, wire=wire)

    async def accumulate_sparse(self, indices: Any, values: np.ndarray, *, wire: str | None = None) -> None:
        await self.buf.accumulate_sparse(indices, values, offset=self.data_off, wire=wire)

    async def flushed(self) -> None:
        pass        # (an acknowledged accumulate is on the servers)


class AgentWeights:
    """The host agent's mirror of the data region (:class:`smb2.mirror.AgentMirror`):
    this host's workers push into one copy on their host and read it, and the
    agent forwards their combined pushes and pulls for them all.

    A lost agent (:class:`~smb2.errors.AgentLost`) is said once at WARNING,
    with how many of this worker's pushes may not have reached the servers,
    and the worker goes on against the servers' own weights
    (:class:`ServerWeights`).  The push that met the loss is not sent again:
    it may have reached the agent, and the agent may have forwarded it, so a
    second send could count it twice; a push is counted once or lost, and a
    lost one is reported, never guessed at."""

    def __init__(self, mirror: AgentMirror, servers: ServerWeights, store: str, rank: int) -> None:
        self.mirror: AgentMirror | None = mirror
        self.servers = servers
        self.store = store
        self.rank = rank
        #: the regions this worker reaches through the same agent, this one
        #: first (:meth:`beside`): lost together, and said once
        self._group: list[AgentWeights] = [self]

    def beside(self, mirror: AgentMirror, servers: ServerWeights) -> AgentWeights:
        """Another region this worker reaches through the same agent (a
        rule's side buffer: ``diloco``'s pending pseudo-gradients).  The two
        are lost together (said once; both go to the servers from then on),
        and :meth:`flushed` waits for both."""
        other = AgentWeights(mirror, servers, self.store, self.rank)
        other._group = self._group
        self._group.append(other)
        return other

    @property
    def via(self) -> str:
        return "agent" if self.mirror is not None else "servers (agent lost)"

    async def read_into(self, out: np.ndarray, offset: int = 0) -> None:
        if self.mirror is not None:
            try:
                await self.mirror.read_into(out, offset)
                return
            except AgentLost as exc:
                self._lose(exc)
        await self.servers.read_into(out, offset)

    async def accumulate(self, offset: int, delta: np.ndarray, *, wire: str | None = None) -> None:
        if self.mirror is None:
            await self.servers.accumulate(offset, delta, wire=wire)
        else:
            await self._push(self.mirror.accumulate(offset, delta, wire=wire))

    async def accumulate_sparse(self, indices: Any, values: np.ndarray, *, wire: str | None = None) -> None:
        if self.mirror is None:
            await self.servers.accumulate_sparse(indices, values, wire=wire)
        else:
            await self._push(self.mirror.accumulate_sparse(indices, values, wire=wire))

    async def flushed(self) -> None:
        """Wait until the agent forwarded every push of this worker, through
        this region and those beside it (a lost agent: said, as for any
        operation; nothing more can be done)."""
        for region in self._group:
            mirror = region.mirror
            if mirror is None:
                continue
            try:
                await region._push(mirror.wait_forwarded(timeout=FLUSH_TIMEOUT))
            except NotifyTimeout:
                uncertain = sum(r.mirror.uncertain for r in self._group if r.mirror is not None)
                log.warning("rank %d of store %r: the host agent at %s did not forward this worker's last pushes "
                            "to the memory servers within %g s (%d of them may be lost); it goes on without the "
                            "agent", self.rank, self.store, mirror.agent, FLUSH_TIMEOUT, uncertain)
                for r in self._group:
                    r.mirror = None
                return

    async def _push(self, push: Awaitable[Any]) -> None:
        try:
            await push
        except AgentLost as exc:
            self._lose(exc)         # (not sent again: see the class's doc)

    def _lose(self, exc: AgentLost) -> None:
        """The agent is lost: every region of the group goes to the servers,
        said once, with the pushes through the other regions that may not
        have reached the servers either."""
        if all(r.mirror is None for r in self._group):
            return
        also = "".join(f" (and {r.mirror.uncertain} of its {r.mirror.pushes} pushes to buffer {r.mirror.spec.remote!r} "
                       "likewise)" for r in self._group
                       if r is not self and r.mirror is not None and r.mirror.uncertain)
        for r in self._group:
            r.mirror = None
        log.warning("rank %d of store %r: %s%s; it goes on, pushing to and pulling from the memory servers "
                    "directly (restart smb2-agent for the next run)", self.rank, self.store, exc.message, also)
