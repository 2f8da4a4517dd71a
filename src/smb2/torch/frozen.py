"""What the store does not train but every rank must agree on: parameters
with ``requires_grad=False`` and the buffers the store does not average
(integer ones such as BatchNorm's ``num_batches_tracked``).

DDP broadcasts them from rank 0 when it wraps the model; so does this.  Rank
0 writes their bytes into a small buffer beside the store (``<store>/frozen``)
before it joins the run, and every other rank copies them into its tensors
after the start barrier (by then rank 0 has written).  A worker whose frozen
*parameters* later differ from what rank 0 handed out (a frozen layer
unfrozen, or changed by hand) would train against a model the others do not
have: :meth:`FrozenTensors.changed` names them, and ``close()`` reports it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..client import Client
from ..errors import BufferConflict
from ..train.store import frozen_state_name


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

    async def publish(self, client: Client, store: str, replicas: int = 1) -> None:
        """Rank 0: write its values beside the store (with the store's ``replicas``)."""
        self._remember()
        if not self.tensors:
            return
        raw = self._pack()
        name = frozen_state_name(store)
        try:
            buf = await client.create(name, raw.size, replicas=replicas)
        except BufferConflict:          # an earlier run's, of another model: replace it
            await client.destroy(name)
            buf = await client.create(name, raw.size, replicas=replicas)
        await buf.write(0, raw)

    async def adopt(self, client: Client, store: str) -> None:
        """Every other rank, after the start barrier: take rank 0's values."""
        if self.tensors:
            buf = await client.attach(frozen_state_name(store))
            raw = np.empty(max(8, self.nbytes), dtype=np.uint8)
            if buf.nbytes != raw.size:
                raise BufferConflict(
                    f"rank 0 of store {store!r} handed out {buf.nbytes} bytes of frozen tensors, this rank's "
                    f"model has {raw.size} ({', '.join(self.names())})",
                    hint="every rank must build the same model (the same layers frozen)")
            await buf.read_into(raw, 0)
            self._unpack(raw)
        self._remember()

    def changed(self) -> list[str]:
        """The frozen parameters whose values differ from rank 0's at start."""
        return [n for n, t, param in self.tensors if param and n in self._digests
                and hashlib.blake2b(self._bytes_of(t).tobytes(), digest_size=16).hexdigest() != self._digests[n]]
