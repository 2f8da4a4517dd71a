"""Staging of torch tensors through host mirrors laid out like a store's data.

A worker's tensors (parameters, float buffers) may be on any device and of
any float dtype; the store holds them as float32 (or float64) in one flat
region.  ``Staging`` moves values between the two, the same way for every
device, so the whole path is tested with CPU tensors:

* ``capture(stage)``: each tensor's change since the last capture (or swap),
  times its scale, into the host ``stage`` (the store's dtype), and into
  every open "since" accumulator;
* ``swap(snapshot, since)``: the tensors become ``snapshot + since`` (a
  pulled copy of the shared values plus this worker's own changes the pull
  did not see yet), in their own dtype.

Host arrays come from :meth:`Staging.host_array`: pinned (page-locked) memory when
the tensors are on a CUDA device, so the device<->host copies are DMA, run
asynchronously on a side CUDA stream that overlaps the default stream's
compute, and (registered with the client by the caller) RDMA reads and writes
land in them without copies.  ``ready()`` waits until the side stream's copies
into host memory are done (the background loop calls it before sending).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError


def flat_values(tensor: Any) -> Any:
    """``tensor``'s values as one flat dense tensor (a sparse gradient,
    such as ``nn.Embedding(sparse=True)``'s, made dense: the store's region
    holds every row)."""
    return (tensor.to_dense() if tensor.is_sparse else tensor).reshape(-1)


@dataclass
class Entry:
    name: str
    tensor: Any          # torch.Tensor (parameter or buffer)
    offset: int          # first element in the flat region
    scale: float         # a change counts this much in the shared copy
    param: bool = True   # a parameter (else a buffer)
    recorded: Any = None  # the tensor's value (store dtype, its device) at the last capture/swap


class Staging:
    """Moves ``entries``' values to and from flat host arrays of ``size``
    elements of ``dtype`` (the store's data region)."""

    def __init__(self, torch: Any, entries: list[Entry], size: int, dtype: np.dtype[Any]) -> None:
        self.torch = torch
        self.entries = entries
        self.size = size
        self.np_dtype = np.dtype(dtype)
        self.dtype = torch.float64 if self.np_dtype == np.float64 else torch.float32
        devices = {e.tensor.device for e in entries}
        if len(devices) != 1:
            raise InvalidArgumentError(f"the model's tensors are on several devices ({sorted(map(str, devices))});"
                                       " smb2.torch needs them on one", hint="move the model with model.to(device)")
        self.device = devices.pop()
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._copied = None
        for e in entries:
            e.recorded = e.tensor.detach().to(self.dtype, copy=True)

    def host_array(self) -> np.ndarray:
        """A zeroed flat host array (pinned when the tensors are on a GPU)."""
        t = self.torch.zeros(self.size, dtype=self.dtype, pin_memory=self.cuda)
        return np.asarray(t.numpy())

    def new_since(self) -> list[Any]:
        """An accumulator of changes, one zeroed tensor per entry (on the device)."""
        return [self.torch.zeros_like(e.recorded) for e in self.entries]

    def _host(self, arr: np.ndarray, e: Entry) -> Any:
        return self.torch.from_numpy(arr[e.offset:e.offset + e.recorded.numel()]).view(e.recorded.shape)

    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        """Device<->host copies on the side stream, after the compute queued so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(self.torch.cuda.current_stream(self.device))
        with self.torch.cuda.stream(self.stream):
            yield
        self._copied = self.stream.record_event()

    def ready(self) -> None:
        """Wait until the copies queued on the side stream are done."""
        if self._copied is not None:
            self._copied.synchronize()

    def capture(self, stage: np.ndarray, since: list[list[Any]]) -> None:
        """Each tensor's change since its record, scaled, into ``stage`` and
        added to each accumulator of ``since``; the record moves on."""
        with self.torch.no_grad(), self._side():
            for i, e in enumerate(self.entries):
                cur = e.tensor.detach().to(self.dtype)
                host = self._host(stage, e)
                # on the CPU the change is computed in the stage itself: no
                # model-sized temporary (and its page faults) per step
                change = self.torch.sub(cur, e.recorded, out=host) if not self.cuda else cur - e.recorded
                if e.scale != 1.0:
                    change.mul_(e.scale)
                e.recorded.copy_(cur)
                for acc in since:
                    acc[i].add_(change)
                if self.cuda:
                    host.copy_(change, non_blocking=True)

    def swap(self, snapshot: np.ndarray, since: list[Any] | None) -> None:
        """The tensors become ``snapshot`` (+ ``since``), in their dtype."""
        with self.torch.no_grad(), self._side():
            for i, e in enumerate(self.entries):
                value = self._host(snapshot, e).to(self.device, non_blocking=self.cuda)
                if since is not None:
                    value = value + since[i]
                e.tensor.copy_(value)
                e.recorded.copy_(e.tensor.detach())
        if self.stream is not None:
            # the model's next forward runs on the default stream: after the new values
            self.torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.ready()    # the snapshot's host memory may be refilled by the next pull

    def add(self, correction: np.ndarray) -> None:
        """The tensors move by the host array ``correction``."""
        with self.torch.no_grad(), self._side():
            for e in self.entries:
                e.tensor.add_(self._host(correction, e).to(self.device, non_blocking=self.cuda))
                e.recorded.copy_(e.tensor.detach())
        if self.stream is not None:
            self.torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.ready()

    def load(self, into: np.ndarray) -> None:
        """The tensors' current values into the host array ``into``."""
        with self.torch.no_grad(), self._side():
            for e in self.entries:
                self._host(into, e).copy_(e.tensor.detach(), non_blocking=self.cuda)
        self.ready()
