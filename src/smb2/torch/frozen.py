"""What the store does not train but every rank must agree on: parameters
with ``requires_grad=False`` and the buffers the store does not average
(integer ones such as BatchNorm's ``num_batches_tracked``).

DDP broadcasts them from rank 0 when it wraps the model; so does this.  Rank
0 writes their bytes into a small buffer beside the store (``<store>/frozen``)
and then, last, the run's generation into its first word; every other rank
waits after the start barrier until that word names its run, and only then
copies the bytes into its tensors.  The barrier alone does not order them:
rank 0 counts as joined from the moment it opens the run, before it writes,
and a buffer left by an earlier run holds an earlier generation, so a rank
never takes half-written or stale values (it waited, or it times out with an
error naming the store).  A worker whose frozen
*parameters* later differ from what rank 0 handed out (a frozen layer
unfrozen, or changed by hand) would train against a model the others do not
have: :meth:`FrozenTensors.changed` names them, and ``close()`` reports it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import numpy as np

from ..client import Client
from ..errors import BufferConflict, NoSuchBuffer, NotifyTimeout
from ..train import beside
from ..train.store import FROZEN

#: the first word of ``<store>/frozen``: the generation of the run whose values follow
_STAMP = 8


class FrozenTensors:
    """The tensors that go from rank 0 to everyone at start, in a fixed
    order: ``(name, tensor, is a parameter)``."""

    def __init__(self, torch: Any, tensors: list[tuple[str, Any, bool]]) -> None:
        self._torch = torch
        self.tensors = tensors
        self.nbytes = sum(t.numel() * t.element_size() for _, t, _ in tensors)
        self._digests: dict[str, str] = {}

    def names(self) -> list[str]:
        return [n for n, _, _ in self.tensors]

    def _bytes_of(self, t: Any) -> np.ndarray:
        return t.detach().to("cpu").contiguous().reshape(-1).view(self._torch.uint8).numpy()

    def _pack(self) -> np.ndarray:
        out = np.empty(max(8, self.nbytes), dtype=np.uint8)
        o = 0
        for _, t, _ in self.tensors:
            b = self._bytes_of(t)
            out[o:o + b.size] = b
            o += b.size
        return out

    def _unpack(self, raw: np.ndarray) -> None:
        o = 0
        with self._torch.no_grad():
            for _, t, _ in self.tensors:
                n = t.numel() * t.element_size()
                src = self._torch.from_numpy(raw[o:o + n].copy()).view(t.dtype).reshape(t.shape)
                t.copy_(src.to(t.device))
                o += n

    def _remember(self) -> None:
        self._digests = {n: hashlib.blake2b(self._bytes_of(t).tobytes(), digest_size=16).hexdigest()
                         for n, t, param in self.tensors if param}

    async def publish(self, client: Client, store: str, generation: int, replicas: int = 1) -> None:
        """Rank 0: write its values beside the store (with the store's
        ``replicas``), then the run's ``generation`` in the first word, last:
        the word says the bytes after it are this run's and whole."""
        self._remember()
        if not self.tensors:
            return
        raw = self._pack()
        # (an earlier run's, of another model, is made again)
        buf = await beside.make(client, store, FROZEN, _STAMP + raw.size, replicas=replicas)
        await buf.write(0, np.zeros(1, np.int64))          # not whole while it is being written
        await buf.write(_STAMP, raw)
        await buf.write(0, np.array([generation], np.int64))

    async def adopt(self, client: Client, store: str, generation: int, timeout: float) -> None:
        """Every other rank, after the start barrier: take rank 0's values
        once rank 0 has written them for run ``generation``."""
        if self.tensors:
            deadline = time.monotonic() + timeout
            delay = 0.005
            while True:
                try:
                    buf = await beside.find(client, store, FROZEN)
                    stamp = np.empty(1, np.int64)
                    await buf.read_into(stamp, 0)
                    if int(stamp[0]) == generation:
                        break
                except NoSuchBuffer:
                    pass                # rank 0 is making it (or replacing an earlier run's)
                if time.monotonic() >= deadline:
                    raise NotifyTimeout(
                        f"rank 0 did not hand out the frozen tensors of store {store!r} (run {generation}) "
                        f"within {timeout:g} s ({', '.join(self.names())})",
                        hint="check that rank 0 is running and reached its first step; raise timeout=")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.1)
            raw = np.empty(max(8, self.nbytes), dtype=np.uint8)
            if buf.nbytes != _STAMP + raw.size:
                raise BufferConflict(
                    f"rank 0 of store {store!r} handed out {buf.nbytes - _STAMP} bytes of frozen tensors, this "
                    f"rank's model has {raw.size} ({', '.join(self.names())})",
                    hint="every rank must build the same model (the same layers frozen)")
            await buf.read_into(raw, _STAMP)
            self._unpack(raw)
        self._remember()

    def changed(self) -> list[str]:
        """The frozen parameters whose values differ from rank 0's at start."""
        return [n for n, t, param in self.tensors if param and n in self._digests
                and hashlib.blake2b(self._bytes_of(t).tobytes(), digest_size=16).hexdigest() != self._digests[n]]
