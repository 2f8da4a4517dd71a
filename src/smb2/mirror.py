"""A worker's mirror of a remote region, kept by its host's agent
(``smb2-agent``, :mod:`smb2.agent`): the worker side.

A host's workers push to and pull from the memory servers through one
agent process on their host: each worker accumulates into a *mirror* of the
remote region on the agent's own memory server (over shm: a memcpy or an
accumulate on the same host), and the agent forwards the host's combined
accumulates as one remote accumulate per cycle and pulls the remote region
once per cycle for all of them (the cycle and why it is exact:
``smb2.agent.forward``).  This module is what a worker imports: it sees
only the client side (the agent's server is an ordinary smb2 server, and
a mirror an ordinary buffer on it), never the server.

A mirror buffer
---------------
There are no new protocol operations.  A mirror of bytes ``[offset,
offset + nbytes)`` of remote buffer ``X`` with elements of ``dtype`` is the
buffer :func:`mirror_name` ``(X, offset, nbytes, dtype)`` on the agent's
server, made by the first worker of the host that asks (``create`` is
idempotent, so host-mates that ask at once share it).  Its layout:

====================  ==================================================
bytes                 what
====================  ==================================================
0-7                   the magic word, written last by the creator: the
                      agent takes the buffer up only once it is there
8-15 (slot 0)         state: 0 starting, 1 ready, 2 failed (the agent's)
16-23 (slot 1)        the forward cycle counter (the agent's)
24-31 (slot 2)        pushes: each worker adds 1 after each push (the
                      agent forwards only when it moved)
32-39 (slot 3)        pulls asked for: a worker adds 1 before each read
40-47 (slot 4)        the pulls served: the agent raises it to the count of
                      slot 3 it read before a pull, once that pull is in
48-383                the remote region as the creator wrote it: offset,
                      nbytes, dtype (16 bytes), the host's workers
                      (below), then the remote name
384-1023              the agent's word on it: an error code (ErrorCode),
                      then a message (why it failed, or what a starting
                      mirror waits for)
HEADER ...            the data: ``nbytes``, zero at creation
base_at(nbytes) ...   the agent's copy of the remote region as of its last
                      pull (``G_base``), kept here so that the agent's memory
                      is what its ``--capacity`` holds
====================  ==================================================

The five words are a notification area, so a worker waits for them on a
futex over shm (:meth:`smb2.client.Buffer.wait_notify`).

The host's workers
------------------
The creator also writes how many of the host's workers use the mirror
(``host_workers``: torchrun's ``LOCAL_WORLD_SIZE`` for the training
store).  The agent gathers that many pushes before it forwards, and that
many asks before it pulls, waiting at most its ``--gather`` seconds after
the first: a host's workers that exchange at about the same time then cost
the servers one push and one pull together, not one each.  Nothing else
changes: a read still waits for a pull that began after its ask (so it
holds everything the servers held when it asked, as a direct read does);
what the gathering adds is that wait, and the time a push stays on the
host before it goes, both at most ``--gather``.

What a worker reads
-------------------
The agent pulls the remote region only when a worker asks: a read adds 1
to slot 3, waits until slot 4 reaches that count, then reads.  The pull
that served it began after the ask, so the read holds everything the
memory servers held when it was asked for, as a direct read would, and
the host's pushes since; the host-mates that ask during one pull share the
next, so a host pulls at most once per its workers' reads and mostly less
(they exchange at about the same time).  Pushes are forwarded without a
pull (the agent's copy of the remote region moves by what it forwarded),
so an idle or pushing host costs the servers no reads.

What a worker can know of its pushes
------------------------------------
The agent raises the cycle counter after each cycle, once the remote
accumulate of that cycle was acknowledged.  A push acknowledged by the
agent's server, after which this worker read the counter as ``c``, is on
the memory servers once the counter reaches ``c + 2``: cycle ``c + 1``
may have read the local data before the push landed, but cycle ``c + 2``
began after ``c + 1`` ended, which was after the read of ``c``, so it read
the push and forwarded it (or saw slot 2 where ``c + 1`` had seen it, which
means ``c + 1`` began after the push had counted itself, and forwarded it).  (A counter read *before* the push bounds
nothing: the worker could stall between its read and its push for any
number of cycles.)  So every push is read back with the counter after it,
one memcpy over shm, and a lost agent (:class:`~smb2.errors.AgentLost`)
states how many of this worker's pushes are confirmed and how many may or
may not have reached the servers.  Nothing is ever pushed again: a push
is on the servers once or not at all.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import os
import struct
from collections.abc import Mapping
from typing import Any, Final, Protocol

import numpy as np

from .checks import check_int
from .errors import (
    AgentLost,
    AgentTimeout,
    ErrorCode,
    InvalidArgumentError,
    NoSuchBuffer,
    NotifyTimeout,
    OutOfMemory,
    StaleHandle,
    TransportError,
    Unsupported,
    server_error,
)

#: the environment variable a worker reads the agent's "host:port" from
AGENT_ENV: Final = "SMB2_AGENT"
#: the agent's default port (the memory servers' is 7420)
DEFAULT_AGENT_PORT: Final = 7430
#: the element types a mirror holds: the training store's
DTYPES: Final = ("float32", "float64")
#: every mirror buffer's name starts so (the agent looks for these)
PREFIX: Final = "mirror/"
MAGIC: Final = int.from_bytes(b"smb2mir3", "little")
#: the magic word of a mirror made by an older smb2 (no host_workers in its header)
OLD_MAGIC: Final = int.from_bytes(b"smb2mir2", "little")
#: the most host workers a header can say
MAX_HOST_WORKERS: Final = 0xFFFF
HEADER: Final = 1024
#: the header's notification slots, from STATE on: the mirror's state and the
#: forward cycle counter (the agent's), the pushes and the pulls the workers
#: asked for (the workers' counters), and the last of those pulls served (the agent's)
STATE: Final = 8
CYCLE: Final = 16
SLOTS: Final = 5
STATE_SLOT, CYCLE_SLOT, PUSHED_SLOT, WANTED_SLOT, SERVED_SLOT = range(SLOTS)
#: a failed mirror raises its served counter to this, so that a worker waiting for a pull wakes
SERVED_ALL: Final = 1 << 62
STARTING, READY, FAILED = 0, 1, 2
# offset u64, nbytes u64, dtype 16 bytes, host workers u16, name (u16 length + bytes)
_SPEC_AT = STATE + 8 * SLOTS
_SPEC = struct.Struct("<QQ16sHH")
_SPEC_END = 384
_NAME_MAX = _SPEC_END - _SPEC_AT - _SPEC.size
WORD_AT: Final = 384          # the agent's: code u64, message (u16 length + bytes)
_WORD = struct.Struct("<QH")
MESSAGE_MAX: Final = HEADER - WORD_AT - _WORD.size
_ALIGN = 64


def base_at(nbytes: int) -> int:
    """Where the agent's copy of the remote region starts in a mirror buffer."""
    return HEADER + -(-nbytes // _ALIGN) * _ALIGN


def buffer_size(nbytes: int) -> int:
    """The size of the mirror buffer of an ``nbytes`` region: the header,
    the data, the agent's copy of the remote region."""
    return base_at(nbytes) + nbytes


def mirror_name(remote: str, offset: int, nbytes: int, dtype: str) -> str:
    """The mirror buffer's name on the agent's server: the same on every
    worker of the host for the same region.  A remote name too long to fit
    whole is replaced by its SHA-256 (the header keeps it whole)."""
    name = f"{PREFIX}{dtype}/{offset}+{nbytes}/{remote}"
    if len(name.encode()) <= 255:
        return name
    return f"{PREFIX}{dtype}/{offset}+{nbytes}/#" + hashlib.sha256(remote.encode()).hexdigest()


class Spec:
    """The remote region a mirror keeps, as its creator wrote it in the header."""

    __slots__ = ("remote", "offset", "nbytes", "dtype", "wire", "host_workers")

    def __init__(self, remote: str, offset: int, nbytes: int, dtype: str, wire: str | None = None,
                 host_workers: int = 1) -> None:
        self.remote = remote
        self.offset = offset
        self.nbytes = nbytes
        self.dtype = dtype
        #: what the agent forwards as: None (``dtype``, exact) or a narrower float type
        self.wire = wire
        #: the pushes (and the asks for a pull) the agent gathers before it forwards (pulls); not part
        #: of the mirror's identity: host-mates that say otherwise share the creator's
        self.host_workers = host_workers

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def key(self) -> tuple[str, int, int, str]:
        return (self.remote, self.offset, self.nbytes, self.types)

    @property
    def types(self) -> str:
        """``dtype``, or ``dtype>wire`` where the agent forwards as ``wire``
        (the header's and the name's one field for both)."""
        return self.dtype if self.wire is None else f"{self.dtype}>{self.wire}"

    def __repr__(self) -> str:
        return f"{self.remote!r}[{self.offset}:{self.offset + self.nbytes}] as {self.types}"

    @property
    def name(self) -> str:
        return mirror_name(self.remote, self.offset, self.nbytes, self.types)

    def encode(self) -> bytes:
        """Bytes 24..384 of the header."""
        name = self.remote.encode()
        dtype = self.types.encode()
        if len(name) > _NAME_MAX or len(dtype) > 16:
            raise InvalidArgumentError(f"a mirror of buffer {self.remote!r} as {self.dtype!r}: the name is at most "
                                       f"{_NAME_MAX} bytes and the dtype 16")
        packed = _SPEC.pack(self.offset, self.nbytes, dtype, self.host_workers, len(name)) + name
        return packed.ljust(_SPEC_END - _SPEC_AT, b"\0")

    @classmethod
    def decode(cls, header: bytes | np.ndarray) -> Spec | None:
        """The spec in a header, None while its magic is not written yet
        (:class:`~smb2.errors.Unsupported` where an older smb2 made it)."""
        raw = bytes(header[:_SPEC_END])
        magic = int.from_bytes(raw[:8], "little")
        if magic == OLD_MAGIC:
            raise Unsupported("the mirror was made by an older smb2, whose header says no host workers",
                              hint="run the same smb2 version on the agent and its workers, and remove the old "
                                   "mirror (smb2 rm on the agent) or restart the agent")
        if magic != MAGIC:
            return None
        offset, nbytes, dtype, host_workers, length = _SPEC.unpack_from(raw, _SPEC_AT)
        start = _SPEC_AT + _SPEC.size
        element, _, wire = dtype.rstrip(b"\0").decode(errors="replace").partition(">")
        return cls(raw[start:start + length].decode(errors="replace"), offset, nbytes, element, wire or None,
                   max(1, host_workers))


def encode_word(code: int, message: str) -> bytes:
    """The agent's word in a header (bytes 384..1024): ``code`` (an
    ErrorCode, 0 for none) and ``message``, cut to fit."""
    text = message.encode()[:MESSAGE_MAX].decode(errors="ignore").encode()
    return (_WORD.pack(code, len(text)) + text).ljust(HEADER - WORD_AT, b"\0")


def decode_word(header: bytes | np.ndarray) -> tuple[int, str]:
    raw = bytes(header[WORD_AT:HEADER])
    code, length = _WORD.unpack_from(raw, 0)
    return code, raw[_WORD.size:_WORD.size + min(length, MESSAGE_MAX)].decode(errors="replace")


def agent_address(environ: Mapping[str, str] | None = None) -> str | None:
    """The agent a worker was told to use (``SMB2_AGENT``), or None."""
    value = (os.environ if environ is None else environ).get(AGENT_ENV, "").strip()
    return value or None


class MirrorBuffer(Protocol):
    """What a mirror needs of a buffer on the agent's server
    (:class:`smb2.Buffer` is one)."""

    name: str
    nbytes: int

    async def read_into(self, out: Any, offset: int = 0, *, timeout: float | None = None) -> None: ...

    async def write(self, offset: int, data: Any, *, timeout: float | None = None) -> None: ...

    async def accumulate(self, offset: int, delta: np.ndarray, *, wire: str | None = None,
                         timeout: float | None = None) -> None: ...

    async def accumulate_sparse(self, indices: Any, values: np.ndarray, *, offset: int = 0,
                                wire: str | None = None, timeout: float | None = None) -> None: ...

    async def wait_notify(self, slot: int, at_least: int = 1, *, timeout: float | None = None) -> int: ...

    async def notify_add(self, slot: int, value: int = 1) -> int: ...

    def set_notify_area(self, offset: int, slots: int) -> Any: ...


class AgentClient(Protocol):
    """What a mirror needs of a client of the agent (:class:`smb2.Client`
    connected to the agent's address is one)."""

    @property
    def servers(self) -> list[str]: ...

    async def create(self, name: str, nbytes: int, *, stripe: int = ..., timeout: float | None = None
                     ) -> MirrorBuffer: ...

    async def destroy(self, name: str, *, timeout: float | None = None) -> bool: ...


class Named(Protocol):
    name: str


class AgentMirror:
    """A worker's handle on the mirror of one remote region, kept by the
    host agent.  Make it with :meth:`open`."""

    def __init__(self, buf: MirrorBuffer, spec: Spec, agent: str) -> None:
        self.buffer = buf
        self.spec = spec
        #: the agent's "host:port"
        self.agent = agent
        self.dtype = np.dtype(spec.dtype)
        self._words = np.zeros(2, np.int64)         # state, cycle as last read
        self._cycle = 0
        # this worker's pushes: started, not yet read back with the counter
        # after them (in flight), read back at cycle c and not yet confirmed
        # ([c, count], oldest first), confirmed
        self._pushes = 0
        self._inflight = 0
        self._pending: collections.deque[list[int]] = collections.deque()
        self._confirmed = 0
        self._dead: BaseException | None = None

    def __repr__(self) -> str:
        return f"<smb2.AgentMirror of {self.spec!r} at agent {self.agent}, cycle {self._cycle}>"

    # -- opening ----------------------------------------------------------------
    @classmethod
    async def open(cls, agent: AgentClient, remote: str | Named, offset: int, nbytes: int,
                   dtype: Any = "float32", *, timeout: float = 30.0, wire: str | None = None,
                   host_workers: int = 1) -> AgentMirror:
        """The mirror of bytes ``[offset, offset + nbytes)`` of the remote
        buffer ``remote`` (a :class:`smb2.Buffer` or its name), elements
        ``dtype`` (float32 or float64), through the agent that ``agent``
        is connected to: made on the agent's server or, where a host-mate
        made it, shared; returned once the agent holds the remote region
        in it.

        ``wire``: what the agent forwards the host's combined pushes as:
        None (``dtype``: the servers get the exact sum) or "bfloat16" /
        "float16" (float32 mirrors: half the bytes).  With a wire, what the
        rounding left out stays on the host and goes with the next forward
        (error feedback), so the servers' copy trails the host's exact sum
        by one rounding of the last forward at most, and nothing is lost.

        ``host_workers``: how many of this host's workers use the mirror
        (torchrun's ``LOCAL_WORLD_SIZE``); the agent gathers that many
        pushes (asks for a pull) before it forwards (pulls), for at most its
        ``--gather`` seconds (see the module's docstring).  The creator's
        value holds for every host-mate.

        Raises what the agent found wrong (:class:`NoSuchBuffer`: no such
        remote buffer; :class:`OutOfBounds`: the region is not inside it;
        :class:`Unsupported`: the dtype), :class:`OutOfMemory` where the
        agent has no room for it, :class:`AgentTimeout` after ``timeout``
        seconds without an answer from the agent, :class:`AgentLost` if the
        agent's connection fails."""
        name = remote if isinstance(remote, str) else remote.name
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"remote must be a buffer or its name, not {remote!r}")
        try:
            dt = np.dtype(dtype).name
        except TypeError:
            raise InvalidArgumentError(f"dtype must be a numpy dtype, not {dtype!r}") from None
        if wire not in (None, "bfloat16", "float16") or (wire is not None and dt != "float32"):
            raise InvalidArgumentError(f"wire must be None, or 'bfloat16' or 'float16' for a float32 mirror, not "
                                       f"{wire!r} for {dt}")
        spec = Spec(name, check_int("offset", offset, low=0), check_int("nbytes", nbytes, low=1), dt, wire,
                    check_int("host_workers", host_workers, low=1))
        if spec.host_workers > MAX_HOST_WORKERS:
            raise InvalidArgumentError(f"host_workers is at most {MAX_HOST_WORKERS}, not {host_workers}")
        spec.encode()       # a name or dtype that does not fit: said before anything is made
        address = agent.servers[0] if agent.servers else "?"
        try:
            remade = False
            for attempt in range(3):
                try:
                    buf = await _create(agent, spec, address)
                    buf.set_notify_area(STATE, SLOTS)
                    header = np.empty(HEADER, np.uint8)
                    await buf.read_into(header, 0)
                    try:
                        found = Spec.decode(header)
                    except Unsupported as exc:
                        raise Unsupported(f"the mirror buffer {spec.name!r} on agent {address}: {exc.message}",
                                          server=address, hint=exc.hint) from None
                    if found is None:
                        # the description first, the magic after it: the
                        # agent takes up only a buffer whose description is whole
                        await buf.write(_SPEC_AT, spec.encode())
                        await buf.write(0, np.array([MAGIC], np.uint64))
                    elif found != spec:
                        raise InvalidArgumentError(f"the mirror buffer {spec.name!r} on agent {address} describes "
                                                   f"{found!r}, not {spec!r}")
                    elif int(header[STATE:STATE + 8].view(np.int64)[0]) == FAILED and not remade:
                        # a failed mirror serves nobody (a host-mate that
                        # holds it has been told): make it again, for a
                        # remote buffer that may exist now
                        remade = True
                        await agent.destroy(spec.name)
                        continue
                    state = await _wait_ready(buf, spec, address, timeout)
                except NoSuchBuffer as exc:
                    if isinstance(exc, StaleHandle) or attempt == 2:
                        raise
                    continue        # a host-mate made it again meanwhile: take theirs
                mirror = cls(buf, spec, address)
                if state == FAILED:
                    raise await mirror._failure()
                await mirror._read_words()
                return mirror
            raise AssertionError("unreachable")
        except (TransportError, StaleHandle) as exc:
            raise _lost(address, spec.remote, 0, 0, 0, exc) from None

    @classmethod
    async def open_pulled(cls, agent: AgentClient, remote: str | Named, offset: int, nbytes: int,
                          dtype: Any = "float32", *, timeout: float = 30.0, wire: str | None = None,
                          host_workers: int = 1) -> AgentMirror:
        """:meth:`open`, then a pull asked for after it: the mirror holds
        what the remote region holds now.  The host's workers that open it
        together ask together, and the agent gathers their asks into one
        pull.  The agent finds a remote buffer destroyed only when it next
        pulls or forwards, so a mirror of an earlier buffer of the remote's
        name (destroyed, and made again under that name, while nobody used
        the mirror: a store removed and run again, or made again for another
        number of workers) fails at this pull: it is made again, once, and
        nothing was pushed through it.  Raises what :meth:`open` does, and
        :class:`AgentTimeout` where the pull takes more than ``timeout``."""
        for attempt in range(2):
            mirror = await cls.open(agent, remote, offset, nbytes, dtype, timeout=timeout, wire=wire,
                                    host_workers=host_workers)
            try:
                await mirror._pull(timeout)
                return mirror
            except NoSuchBuffer as exc:
                if attempt or isinstance(exc, StaleHandle):
                    raise
        raise AssertionError("unreachable")

    # -- what a worker reads of it -----------------------------------------------
    @property
    def cycle(self) -> int:
        """The agent's forward cycle counter as this worker last read it."""
        return self._cycle

    @property
    def pushes(self) -> int:
        """This worker's pushes through the mirror so far."""
        return self._pushes

    @property
    def confirmed(self) -> int:
        """Those of them surely on the memory servers."""
        return self._confirmed

    @property
    def uncertain(self) -> int:
        """Those not confirmed yet (in flight, or not two cycles old)."""
        return self._inflight + sum(count for _, count in self._pending)

    # -- operations ----------------------------------------------------------------
    async def accumulate(self, rel_offset: int, array: np.ndarray, *, wire: str | None = None) -> None:
        """``mirror[rel_offset:...] += array`` (bytes from the region's start),
        as :meth:`smb2.Buffer.accumulate` does: ``array`` of the mirror's
        dtype, or float32 with ``wire="bfloat16"`` / ``"float16"`` into a
        float32 mirror.  The agent forwards it with its next cycle."""
        self._live()
        if not isinstance(array, np.ndarray):
            raise InvalidArgumentError(f"array must be a numpy array, not {type(array).__name__}")
        if array.dtype != self.dtype:
            raise InvalidArgumentError(f"the mirror of {self.spec!r} adds {self.dtype} values, not {array.dtype}")
        # with a wire, the values travel narrower and land as float32: the
        # range they cover is the array's own
        self._range(rel_offset, array.nbytes, "an accumulate")
        await self._push(self.buffer.accumulate(HEADER + rel_offset, array, wire=wire))

    async def accumulate_sparse(self, indices: Any, values: np.ndarray, *, offset: int = 0,
                                wire: str | None = None) -> None:
        """``mirror.view(float32)[offset // 4 + indices] += values`` (offset in
        bytes from the region's start), as
        :meth:`smb2.Buffer.accumulate_sparse` does; float32 mirrors only."""
        self._live()
        if self.dtype != np.float32:
            raise InvalidArgumentError(f"a sparse accumulate adds float32 words; the mirror of {self.spec!r} "
                                       f"holds {self.dtype}")
        self._range(offset, 0, "a sparse accumulate")
        await self._push(self.buffer.accumulate_sparse(indices, values, offset=HEADER + offset, wire=wire))

    async def read_into(self, out: Any, rel_offset: int = 0) -> None:
        """Fill ``out`` with the mirror's data from ``rel_offset``: the remote
        region as of a pull the agent began after this call, plus the host's
        pushes not forwarded yet.  Reads the agent's state and counter too
        (over shm, where the agent is, each read is a memcpy in this process)."""
        self._live()
        self._range(rel_offset, out.nbytes if isinstance(out, np.ndarray) else memoryview(out).nbytes, "a read")
        try:
            await self._pulled()
            await self.buffer.read_into(out, HEADER + rel_offset)
        except (TransportError, StaleHandle) as exc:
            raise self._lose(exc) from None
        await self._read_words()

    async def read(self) -> np.ndarray:
        """The mirror's whole data, a new array of its dtype, read in one
        read with the agent's state and counter."""
        self._live()
        whole = np.empty(HEADER - STATE + self.spec.nbytes, np.uint8)
        try:
            await self._pulled()
            await self.buffer.read_into(whole, STATE)
        except (TransportError, StaleHandle) as exc:
            raise self._lose(exc) from None
        await self._saw(whole[:16].view(np.int64))
        return whole[HEADER - STATE:].view(self.dtype)

    async def wait_cycle(self, at_least: int, *, timeout: float | None = None) -> int:
        """Wait until the agent's counter reaches ``at_least``; its value."""
        self._live()
        try:
            await self.buffer.wait_notify(CYCLE_SLOT, at_least, timeout=timeout)
        except (TransportError, StaleHandle) as exc:
            raise self._lose(exc) from None
        await self._read_words()
        return self._cycle

    async def wait_forwarded(self, *, timeout: float | None = None) -> int:
        """Wait until every push this worker made is surely on the memory
        servers (:attr:`uncertain` is 0); the counter's value."""
        if self._inflight:
            raise InvalidArgumentError("wait_forwarded waits for pushes that returned; some are still running")
        target = self._pending[-1][0] + 2 if self._pending else self._cycle
        return await self.wait_cycle(target, timeout=timeout)

    # -- inside ---------------------------------------------------------------------
    def _live(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _range(self, rel_offset: Any, length: int, what: str) -> None:
        rel = check_int("offset", rel_offset, low=0)
        if rel + length > self.spec.nbytes:
            raise InvalidArgumentError(f"{what} of {length} bytes at offset {rel} runs past the end of the mirror "
                                       f"of {self.spec!r} ({self.spec.nbytes} bytes)")

    async def _pull(self, timeout: float) -> None:
        """A pull asked for now, waited for (up to ``timeout``), without a read."""
        try:
            await asyncio.wait_for(self._pulled(), timeout)
        except (TransportError, StaleHandle) as exc:
            raise self._lose(exc) from None
        except TimeoutError:
            raise AgentTimeout(f"the host agent at {self.agent} did not pull the mirror of {self.spec!r} within "
                               f"{timeout:g} s", hint=f"check that smb2-agent runs on this host, or unset {AGENT_ENV} "
                               "to reach the memory servers directly") from None
        await self._read_words()

    async def _pulled(self) -> None:
        """Ask the agent for a pull and wait until one that began after the ask is in."""
        asked = await self.buffer.notify_add(WANTED_SLOT, 1) + 1
        await self.buffer.wait_notify(SERVED_SLOT, asked)

    async def _push(self, op: Any) -> None:
        self._pushes += 1
        self._inflight += 1
        try:
            await op
            await self.buffer.notify_add(PUSHED_SLOT, 1)
        except (TransportError, StaleHandle) as exc:
            raise self._lose(exc) from None
        except BaseException:
            # refused before anything was added (a bad argument): not a push
            self._pushes -= 1
            self._inflight -= 1
            raise
        # the counter read after the push (see the module's docstring): the
        # push counts as in flight until then
        await self._read_words()
        self._inflight -= 1
        if self._pending and self._pending[-1][0] == self._cycle:
            self._pending[-1][1] += 1
        else:
            self._pending.append([self._cycle, 1])

    async def _read_words(self) -> None:
        try:
            await self.buffer.read_into(self._words, STATE)
        except (TransportError, StaleHandle) as exc:
            raise self._lose(exc) from None
        await self._saw(self._words)

    async def _saw(self, words: np.ndarray) -> None:
        state, cycle = int(words[0]), int(words[1])
        self._cycle = max(self._cycle, cycle)
        while self._pending and self._pending[0][0] + 2 <= self._cycle:
            self._confirmed += self._pending.popleft()[1]
        if state == FAILED:
            err = await self._failure()
            self._dead = err
            raise err

    async def _failure(self) -> Exception:
        """The agent's reason for a failed mirror, as the error it names."""
        header = np.empty(HEADER, np.uint8)
        try:
            await self.buffer.read_into(header, 0)
        except (TransportError, StaleHandle) as exc:
            return self._lose(exc)
        code, message = decode_word(header)
        if self._pushes:
            message += (f" ({self.uncertain} of this worker's {self._pushes} pushes through it may not have "
                        "reached the memory servers)")
        try:
            return server_error(ErrorCode(code) if code else ErrorCode.INTERNAL, message, self.agent)
        except ValueError:
            return server_error(ErrorCode.INTERNAL, message, self.agent)

    def _lose(self, exc: BaseException) -> AgentLost:
        if self._dead is None:
            self._dead = _lost(self.agent, self.spec.remote, self._pushes, self._confirmed, self.uncertain, exc)
        assert isinstance(self._dead, AgentLost)
        return self._dead


async def _create(agent: AgentClient, spec: Spec, address: str) -> MirrorBuffer:
    size = buffer_size(spec.nbytes)
    try:
        # one stripe: the agent is one server, and a buffer takes whole
        # stripes of its memory
        return await agent.create(spec.name, size, stripe=-(-size // 8) * 8)
    except OutOfMemory as exc:
        raise OutOfMemory(
            f"the host agent at {address} has no room for a mirror of {spec!r}: it needs {size} bytes (the "
            f"region twice: the data and the agent's copy of the servers' region) ({exc.message})",
            server=address, hint="start smb2-agent with a larger --capacity, or mirror a smaller region") from None


async def _wait_ready(buf: MirrorBuffer, spec: Spec, address: str, timeout: float) -> int:
    try:
        return await buf.wait_notify(0, READY, timeout=timeout)
    except NotifyTimeout:
        header = np.empty(HEADER, np.uint8)
        await buf.read_into(header, 0)
        _, said = decode_word(header)
        why = (f"it says: {said}" if said else
               "nothing there took it up: is smb2-agent running at that address (a plain smb2-server never "
               "readies a mirror)?")
        hint = (f"check that the memory servers run and that the agent's --servers names them, or unset "
                f"{AGENT_ENV} to reach them directly" if said else
                f"start smb2-agent on this host (and point {AGENT_ENV} at it), or unset {AGENT_ENV} to reach the "
                "memory servers directly")
        raise AgentTimeout(f"the host agent at {address} did not make the mirror of {spec!r} ready within "
                           f"{timeout:g} s; {why}", hint=hint) from None


def _lost(agent: str, remote: str, pushes: int, confirmed: int, uncertain: int, exc: BaseException) -> AgentLost:
    why = getattr(exc, "message", None) or str(exc)
    restarted = isinstance(exc, NoSuchBuffer)
    return AgentLost(
        f"the host agent at {agent} {'restarted' if restarted else 'stopped'} ({why}): {uncertain} of this "
        f"worker's {pushes} pushes to buffer {remote!r} since the agent's last confirmed forward may not have "
        f"reached the memory servers ({confirmed} did)",
        agent=agent, buffer=remote, pushes=pushes, confirmed=confirmed, uncertain=uncertain,
        detail=f"buffer {remote!r} on the memory servers is intact: every push on it counts once, and nothing is "
               "pushed again, so nothing counts twice",
        hint=f"restart smb2-agent on this host, or unset {AGENT_ENV} to reach the memory servers directly")
