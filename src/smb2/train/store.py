"""ParameterStore: a model's named tensors laid out in one striped buffer.

The buffer describes itself, so a worker that knows only its name can attach
(ETRI's design: a mapping table of named parameters inside the shared memory)::

    byte 0      preamble, eight int64 words
                  magic "SMB2PSTR" | format | state | table bytes |
                  data offset | data bytes | notify offset | notify slots
    byte 64     the layout table, msgpack: tensors [name, dtype, shape, offset],
                  the update rule and its settings, the number of workers
    (8-aligned) the notification area (see smb2.notify):
                  slot 0 parameter version (updates applied so far)
                  slot 1 stop flag (the end policy fired)
                  slot 2 workers that joined (the start barrier)
                  slots 8 + rank: each worker's iteration count (progress table)
    (4 KiB)     the data: every tensor at a 64-byte aligned offset

``state`` is 0 (empty), 1 (being initialized) or 2 (ready).  The first worker
to take the buffer's lock and find it not ready writes the table and the
initial values, then sets it to 2 (all with fenced writes); everyone else
waits for 2.  The data region is one contiguous range, so
``pull`` is a single read that the client splits over every server and runs
concurrently.

Each worker keeps a local mirror of the data region; ``store.params[name]`` are
numpy views into it (a torch module's parameters can be bound to them without
copies, see :mod:`smb2.torch`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from ..client import Buffer, Client
from ..errors import BufferConflict, InterfaceError, InvalidArgumentError, NoSuchBuffer, NotifyTimeout
from ..lock import Lock
from .dropping import LayerDropping
from .rules import UpdateRule, make_rule

log = logging.getLogger("smb2.train")

MAGIC = int.from_bytes(b"SMB2PSTR", "little")
FORMAT = 1
PREAMBLE = 64
# byte offsets of the preamble's words
_MAGIC, _FORMAT, _STATE, _TABLE, _DATA_OFF, _DATA_LEN, _NOTE_OFF, _NOTE_SLOTS = range(0, 64, 8)
EMPTY, INITIALIZING, READY = 0, 1, 2

#: notification slots of the store
SLOT_VERSION = 0
SLOT_STOP = 1
SLOT_JOINED = 2
SLOT_PROGRESS = 8       # + rank
POLICIES = ("first", "slowest", "average")
DTYPES = ("float32", "float64")

ALIGN = 64              # tensors start on cache-line boundaries
DATA_ALIGN = 4096


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Layout:
    """Names, dtype, shapes and offsets of the tensors; pure, no I/O."""

    def __init__(self, tensors: list[tuple[str, str, tuple[int, ...], int]], workers: int,
                 rule: dict[str, Any]) -> None:
        self.tensors = tensors
        self.workers = workers
        self.rule = rule
        self.dtype = np.dtype(tensors[0][1])
        self.data_len = _round_up(max(off + self.nbytes_of(shape) for _, _, shape, off in tensors), 8)

    def nbytes_of(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.dtype.itemsize

    @classmethod
    def plan(cls, params: Mapping[str, np.ndarray], workers: int, rule: dict[str, Any]) -> Layout:
        if not isinstance(params, Mapping) or not params:
            raise InvalidArgumentError("params must be a non-empty mapping of name -> numpy array")
        dtypes = set()
        tensors = []
        off = 0
        for name, arr in params.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"tensor names are non-empty strings, not {name!r}")
            if not isinstance(arr, np.ndarray):
                raise InvalidArgumentError(f"tensor {name!r} is a {type(arr).__name__}, not a numpy array")
            if arr.dtype.name not in DTYPES:
                raise InvalidArgumentError(f"tensor {name!r} is {arr.dtype}; the store holds {' or '.join(DTYPES)}")
            dtypes.add(arr.dtype.name)
            tensors.append((name, arr.dtype.name, tuple(int(d) for d in arr.shape), off))
            off = _round_up(off + arr.nbytes, ALIGN)
        if len(dtypes) > 1:
            raise InvalidArgumentError(f"all tensors of a store share one dtype, not {sorted(dtypes)}")
        return cls(tensors, workers, rule)

    def table(self) -> bytes:
        return msgpack.packb({"tensors": [[n, d, list(s), o] for n, d, s, o in self.tensors],
                              "workers": self.workers, "rule": self.rule})

    @classmethod
    def from_table(cls, raw: bytes) -> Layout:
        t = msgpack.unpackb(raw)
        return cls([(n, d, tuple(s), o) for n, d, s, o in t["tensors"]], int(t["workers"]), dict(t["rule"]))

    def geometry(self) -> tuple[int, int, int, int]:
        """(notify offset, notify slots, data offset, total bytes)."""
        note_off = _round_up(PREAMBLE + len(self.table()), 8)
        slots = SLOT_PROGRESS + self.workers
        data_off = _round_up(note_off + 8 * slots, DATA_ALIGN)
        return note_off, slots, data_off, data_off + self.data_len

    def same_as(self, other: Layout) -> bool:
        return self.tensors == other.tensors


class ParameterStore:
    """Named tensors in one shared buffer, a local mirror, and an update rule.

    Make it with :meth:`open` (create or attach, with the model's initial
    values) or :meth:`attach` (by name only)."""

    def __init__(self, client: Client, buf: Buffer, layout: Layout, data_off: int, *,
                 rank: int, rule: UpdateRule, dropping: LayerDropping | None) -> None:
        self.client = client
        self.buf = buf
        self.layout = layout
        self.data_off = data_off
        self.rank = rank
        self.workers = layout.workers
        #: the local mirror of the whole data region (bytes)
        self.mirror = np.zeros(layout.data_len, dtype=np.uint8)
        #: name -> numpy view of the mirror
        self.params: dict[str, np.ndarray] = {}
        #: name -> (byte offset in the buffer, nbytes)
        self.ranges: dict[str, tuple[int, int]] = {}
        for name, _dt, shape, off in layout.tensors:
            n = layout.nbytes_of(shape)
            self.params[name] = self.mirror[off:off + n].view(layout.dtype).reshape(shape)
            self.ranges[name] = (data_off + off, n)
        self.rule = rule
        self.dropping = dropping
        if dropping is not None and not rule.gradient_rule:
            raise InvalidArgumentError(f"layer dropping applies to gradient rules, not {rule.name!r}")
        #: the last parameter version this worker saw
        self.version = 0
        self.iteration = 0
        self.stats = {"pulls": 0, "pushes": 0, "bytes_pulled": 0, "bytes_pushed": 0}
        rule.bind(self)

    # -- opening ----------------------------------------------------------------
    @classmethod
    async def open(cls, client: Client, name: str, params: Mapping[str, np.ndarray], *,
                   rule: str | UpdateRule = "accumulate", workers: int = 1, rank: int = 0,
                   dropping: LayerDropping | None = None, stripe: int | None = None,
                   timeout: float = 60.0, **rule_options: Any) -> ParameterStore:
        """Create the store ``name`` (or attach to it if it exists) for a model
        whose tensors and initial values are ``params``.

        The first worker to get here writes the layout table and ``params``;
        the others wait until it is ready and then read the shared values
        into their mirror.  All workers must pass the same tensor names,
        shapes and dtype (the initial values of the others are ignored)."""
        rule_obj = make_rule(rule, **rule_options)
        workers = _check_rank(rank, workers)
        layout = Layout.plan(params, workers, rule_obj.settings())
        note_off, slots, data_off, total = layout.geometry()
        kw = {} if stripe is None else {"stripe": stripe}
        try:
            buf = await client.create(name, total, **kw)
        except BufferConflict as exc:
            # another size: another model (or another number of workers)
            raise InvalidArgumentError(f"store {name!r} exists with another layout or geometry",
                                       detail=str(exc)) from exc
        buf.set_notify_area(note_off, slots)
        # the first worker initializes, under the buffer's lock: the others
        # queue behind it and find the store ready; if it dies half-way, its
        # lease runs out and the next one in line starts over
        lock = buf.lock()
        await lock.acquire(timeout=timeout)
        try:
            state = await buf.fetch_add(_STATE, 0)
            if state != READY:
                await buf.write(_STATE, np.array([INITIALIZING], dtype=np.int64), fence=lock)
                await _write_words(buf, {_MAGIC: MAGIC, _FORMAT: FORMAT, _TABLE: len(layout.table()),
                                         _DATA_OFF: data_off, _DATA_LEN: layout.data_len,
                                         _NOTE_OFF: note_off, _NOTE_SLOTS: slots}, fence=lock)
                await buf.write(PREAMBLE, layout.table(), fence=lock)
                store = cls(client, buf, layout, data_off, rank=rank, rule=rule_obj, dropping=dropping)
                for tname, arr in params.items():
                    store.params[tname][...] = arr
                await buf.write(data_off, store.mirror, fence=lock)
                # the ready state last, after the table and the values are in place everywhere
                await buf.write(_STATE, np.array([READY], dtype=np.int64), fence=lock)
                log.info("store %r created: %d tensors, %d bytes of %s, %d workers, rule %s",
                         name, len(layout.tensors), layout.data_len, layout.dtype, workers, rule_obj.name)
                return store
        finally:
            await lock.release()
        theirs, data_off2 = await _read_layout(buf, timeout)
        if not theirs.same_as(layout) or data_off2 != data_off:
            raise InvalidArgumentError(
                f"store {name!r} exists with another layout",
                detail=f"theirs: {theirs.tensors}, ours: {layout.tensors}")
        store = cls(client, buf, theirs, data_off, rank=rank, rule=rule_obj, dropping=dropping)
        await store.pull()
        return store

    @classmethod
    async def attach(cls, client: Client, name: str, *, rank: int = 0, rule: str | UpdateRule | None = None,
                     dropping: LayerDropping | None = None, timeout: float = 60.0,
                     **rule_options: Any) -> ParameterStore:
        """Attach to the store ``name`` knowing nothing but its name: waits
        (up to ``timeout`` s) for the buffer to exist and be initialized,
        reads the layout table from it and pulls the parameters.  The update
        rule defaults to the one recorded by the creator."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                buf = await client.attach(name)
                break
            except NoSuchBuffer:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        layout, data_off = await _read_layout(buf, max(0.0, deadline - time.monotonic()))
        if rule is None:
            settings = dict(layout.rule)
            rule = settings.pop("name")
            settings.update(rule_options)
            rule_options = settings
        rule_obj = make_rule(rule, **rule_options)
        _check_rank(rank, layout.workers)
        store = cls(client, buf, layout, data_off, rank=rank, rule=rule_obj, dropping=dropping)
        await store.pull()
        return store

    # -- data -------------------------------------------------------------------
    async def pull(self) -> None:
        """Read every parameter into the mirror (one read over all servers)."""
        await self.buf.read_into(self.mirror, self.data_off)
        self.stats["pulls"] += 1
        self.stats["bytes_pulled"] += self.mirror.nbytes

    async def push(self, grads: Mapping[str, np.ndarray]) -> None:
        """Apply one step's gradients with the update rule (layer dropping
        first, if the store has it), then count the update in the version."""
        self._check_grads(grads)
        await self.rule.push(grads)
        self.stats["pushes"] += 1

    def _check_grads(self, grads: Mapping[str, np.ndarray]) -> None:
        if not isinstance(grads, Mapping):
            raise InvalidArgumentError(f"grads must map tensor names to arrays, not {type(grads).__name__}")
        for name, g in grads.items():
            p = self.params.get(name)
            if p is None:
                raise InvalidArgumentError(f"no tensor {name!r} in the store (it has {list(self.params)})")
            if not isinstance(g, np.ndarray) or g.shape != p.shape:
                raise InvalidArgumentError(
                    f"gradient of {name!r} must be an array of shape {p.shape}, "
                    f"not {getattr(g, 'shape', type(g).__name__)}")

    def flat(self) -> np.ndarray:
        """The whole data region as one array of the store's dtype (a view)."""
        return self.mirror.view(self.layout.dtype)

    def flat_offset(self, name: str) -> int:
        """Where tensor ``name`` starts in :meth:`flat` (elements)."""
        return (self.ranges[name][0] - self.data_off) // self.layout.dtype.itemsize

    # -- version and progress (notifications) --------------------------------------
    async def bump_version(self) -> int:
        """Count one applied update; called by the rules after their data."""
        self.version = await self.buf.notify_add(SLOT_VERSION, 1) + 1
        return self.version

    async def read_version(self) -> int:
        self.version = await self.buf.read_notify(SLOT_VERSION)
        return self.version

    async def wait_version(self, at_least: int, timeout: float | None = None) -> int:
        """Wait until at least ``at_least`` updates were applied in all."""
        self.version = await self.buf.wait_notify(SLOT_VERSION, at_least, timeout=timeout)
        return self.version

    async def join(self, timeout: float | None = None) -> None:
        """Start together: count this worker in and wait until all
        ``workers`` have (a one-shot barrier on one notification slot)."""
        await self.buf.notify_add(SLOT_JOINED, 1)
        await self.buf.wait_notify(SLOT_JOINED, self.workers, timeout=timeout)

    async def report(self, iteration: int, target: int, policy: str = "average") -> bool:
        """Publish this worker's iteration count and tell whether the job is
        over: by ``policy`` "first" (some worker reached ``target``), "slowest"
        (all did) or "average" (the mean did).  When it is, the stop flag is
        raised so that every worker ends at its next report."""
        if policy not in POLICIES:
            raise InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.iteration = iteration
        await self.buf.notify(SLOT_PROGRESS + self.rank, iteration)
        slots = await self.buf.read_notify()
        if slots[SLOT_STOP]:
            return True
        progress = slots[SLOT_PROGRESS:SLOT_PROGRESS + self.workers]
        level = {"first": progress.max(), "slowest": progress.min(), "average": progress.mean()}[policy]
        if level >= target:
            await self.buf.notify(SLOT_STOP, 1)
            log.info("worker %d: the %s worker reached %d iterations: stopping all", self.rank, policy, target)
            return True
        return False

    async def progress(self) -> np.ndarray:
        """Every worker's iteration count (the progress table)."""
        slots = await self.buf.read_notify()
        return slots[SLOT_PROGRESS:SLOT_PROGRESS + self.workers]

    async def stopped(self) -> bool:
        return bool(await self.buf.read_notify(SLOT_STOP))

    async def wait_stopped(self, timeout: float | None = None) -> None:
        await self.buf.wait_notify(SLOT_STOP, 1, timeout=timeout)

    async def destroy(self) -> None:
        await self.client.destroy(self.buf.name)


def _check_rank(rank: Any, workers: Any) -> int:
    for what, v in (("rank", rank), ("workers", workers)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise InvalidArgumentError(f"{what} must be an int, not {type(v).__name__}")
    if workers < 1 or not 0 <= rank < workers:
        raise InvalidArgumentError(f"rank {rank} is not in range for {workers} workers")
    return int(workers)


async def _write_words(buf: Buffer, words: dict[int, int], fence: Lock) -> None:
    """Write int64 words, one write per run of adjacent words (never
    touching the words in between, such as the state word)."""
    runs: list[list[int]] = []
    for off in sorted(words):
        if runs and runs[-1][-1] + 8 == off:
            runs[-1].append(off)
        else:
            runs.append([off])
    await asyncio.gather(*(buf.write(run[0], np.array([words[o] for o in run], dtype=np.int64), fence=fence)
                           for run in runs))


async def _read_layout(buf: Buffer, timeout: float) -> tuple[Layout, int]:
    """Wait until the store is ready, then read its preamble and table."""
    try:
        from ..notify import wait_word
        await wait_word(buf, _STATE, READY, timeout, what="the store's ready state")
    except NotifyTimeout:
        raise NotifyTimeout(f"store {buf.name!r} was not initialized within {timeout} s "
                            "(did its creator die?)") from None
    pre = np.empty(PREAMBLE // 8, dtype=np.int64)
    await buf.read_into(pre, 0)
    if int(pre[_MAGIC // 8]) != MAGIC:
        raise InterfaceError(f"buffer {buf.name!r} is not a parameter store (bad magic)")
    if int(pre[_FORMAT // 8]) != FORMAT:
        raise InterfaceError(f"store {buf.name!r} has format {int(pre[1])}; this smb2 reads {FORMAT}")
    table = await buf.read(PREAMBLE, int(pre[_TABLE // 8]))
    layout = Layout.from_table(table.tobytes())
    buf.set_notify_area(int(pre[_NOTE_OFF // 8]), int(pre[_NOTE_SLOTS // 8]))
    return layout, int(pre[_DATA_OFF // 8])
