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
from typing import Any, Protocol

import numpy as np

from ..client import Buffer

log = logging.getLogger("smb2.train.weights")


class SharedWeights(Protocol):
    """The three operations the rules and the store use on the shared weights."""

    async def read_into(self, out: np.ndarray, offset: int = 0) -> None: ...

    async def accumulate(self, offset: int, delta: np.ndarray, *, wire: str | None = None) -> None: ...

    async def accumulate_sparse(self, indices: Any, values: np.ndarray, *, wire: str | None = None) -> None: ...


class ServerWeights:
    """The data region of ``buf`` (starting at byte ``data_off``) on the memory servers."""

    def __init__(self, buf: Buffer, data_off: int) -> None:
        self.buf = buf
        self.data_off = data_off

    async def read_into(self, out: np.ndarray, offset: int = 0) -> None:
        await self.buf.read_into(out, self.data_off + offset)

    async def accumulate(self, offset: int, delta: np.ndarray, *, wire: str | None = None) -> None:
        await self.buf.accumulate(self.data_off + offset, delta, wire=wire)

    async def accumulate_sparse(self, indices: Any, values: np.ndarray, *, wire: str | None = None) -> None:
        await self.buf.accumulate_sparse(indices, values, offset=self.data_off, wire=wire)
