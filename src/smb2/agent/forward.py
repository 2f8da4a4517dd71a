"""The agent's side of one mirror: taking it up, the forward cycle, failing it.

The forward cycle
-----------------
A mirror keeps the buffer on the agent's server equal to ``G_base + P``:
``G_base`` the remote region as the agent last knew it, ``P`` the local
accumulates not yet forwarded.  The agent keeps ``G_base`` in the mirror
buffer itself (``smb2.mirror.base_at``), zero at first.  A cycle, at most
every ``period`` seconds, reads the header's counters and works per chunk
of the region (``CHUNK`` bytes, so that the agent's own memory stays a few
chunks whatever the region's size):

* **forward**, if the workers' push counter moved since the last forward:
  read the local data ``L``; ``D = L - G_base``; where ``D`` has a nonzero
  element, remote ``accumulate(offset, D)`` in the mirror's own dtype (no
  narrow wire: what is forwarded is what was pushed); ``G_base += D``.
  The local data is not touched: it is ``G_base + (P - D)`` now.
* **pull**, if a worker asked for one since the last (the workers' pull
  counter is past the served one): read the servers' ``G_new``; local
  ``accumulate(G_new - G_base)``; ``G_base = G_new``; then raise the
  served counter to the asks read before the pull.

and then the header's cycle counter is raised by one (after the remote
accumulates were acknowledged).  A host that only pushes costs the servers
no reads; its workers' reads, however many at once, share pulls.

Gathering.  A forward waits until the pushes since the last one number the
host's workers (the header's ``host_workers``), and a pull until the asks
do, or until ``gather`` seconds have passed since the cycle that first saw
one of them (the last cycle before the agent stops forwards at once).  A
cycle that leaves pushes it saw for later does not raise the counter: every
raise still comes after a cycle that forwarded every push counted before it
began, which is what a worker's confirmation (``smb2.mirror``) rests on.

Why it is exact.  Element by element, the local value is ``G_base + P``.
A worker's accumulate into element ``i`` lands either before the agent's
read of ``L[i]`` or after it.  Before: it is in ``D[i]``, forwarded once,
and moves from ``P`` into ``G_base``.  After: it is not in ``D``, and stays
in ``P`` for the next forward.  A pull's correction ``G_new - G_base`` is
itself an accumulate, so it composes with the workers' accumulates that
land meanwhile: after it the local value is ``G_new + P``.  So every push
reaches the remote region exactly once; with integer-valued floats (below
2**24 for float32) the remote region is the exact sum of every push.  With
other values the arithmetic of ``D`` and the correction rounds like any
float sum.  The first cycle pulls (``G_base = 0``, nothing pushed): it
brings the remote region in, and the mirror is ready.

When a forward fails.  A remote accumulate that raised may or may not have
landed (its connection broke after the request left; a region over several
servers may have landed on some).  It is never sent again: the agent counts
it in ``G_base`` as if it had landed, so it counts once or not at all
(the next pull takes it out of the local data too where it did not land)
-- never twice -- and a WARNING says how many bytes may be lost.  Before it
forwards, the agent makes sure it is connected to every server (a pull
reconnects), so a server that is merely down costs a retry, not a loss.
Errors reaching the memory servers are retried with backoff (WARNING); a
remote buffer that is gone (destroyed, or its server restarted without it)
fails the mirror with a message in the header, which the workers raise
(and wakes the workers that wait for a pull).

What is kept, and for how long.  A mirror lives as long as its buffer on
the agent's server: host-mates share it and none of them knows whether the
others are done, so nothing destroys a mirror that works; it stops with
the agent, or fails when its remote buffer is gone (a worker that opens a
failed mirror makes it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

import numpy as np

from ..client import Buffer, Client, as_wire
from ..errors import (
    BufferDamaged,
    ErrorCode,
    InterfaceError,
    NoSuchBuffer,
    ServerError,
    StaleHandle,
    TransportError,
    Unsupported,
)
from ..mirror import (
    CYCLE_SLOT,
    DTYPES,
    FAILED,
    HEADER,
    PUSHED_SLOT,
    READY,
    SERVED_ALL,
    SERVED_SLOT,
    SLOTS,
    STATE,
    WANTED_SLOT,
    WORD_AT,
    Spec,
    base_at,
    buffer_size,
    encode_word,
)

log = logging.getLogger("smb2.agent")

#: the bytes of the region one step of a cycle covers: the agent holds three
#: chunks per mirror, and a remote request of this size is cut per stripe
CHUNK = 4 << 20
#: the shortest time between two cycles of one mirror, in seconds: far below
#: a training step (tens of ms and more), so the agent adds at most about
#: this to how stale a worker's view is, while an idle small mirror costs
#: some 200 pulls a second (a large one is bound by its own transfer time)
DEFAULT_PERIOD = 0.005
#: the longest a forward (a pull) waits for the rest of the host's workers'
#: pushes (asks), in seconds: a few cycles, short beside a training step, so
#: that a host whose workers exchange together sends one push and one pull
DEFAULT_GATHER = 0.02
#: how often a new mirror buffer waits for its creator's magic word
WAIT_MAGIC = 0.05
# retries of errors reaching the memory servers: from this ...
FIRST_BACKOFF = 0.05
# ... doubling to this, in seconds
MAX_BACKOFF = 2.0
# a mirror that keeps failing is logged at most this often (seconds)
LOG_EVERY = 10.0

T = TypeVar("T")


class Remote(Protocol):
    """What a mirror needs of the agent: its client of the memory servers."""

    @property
    def servers(self) -> list[str]: ...

    @property
    def trouble(self) -> str | None:
        """Why the memory servers cannot be reached now (None: connected)."""

    async def client(self) -> Client: ...


class Failed(Exception):
    """The mirror cannot be kept: ``code`` (an ErrorCode) and a message in
    the worker's terms, which the agent writes into the header."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LocalGone(Exception):
    """The mirror buffer is gone from the agent's server (removed by hand)."""


class Mirror:
    """The agent's side of one mirror buffer (``name``, segment ``segment``
    of the agent's server).  :meth:`run` is its task."""

    def __init__(self, local_client: Client, name: str, segment: int, remote: Remote,
                 period: float = DEFAULT_PERIOD, gather: float = DEFAULT_GATHER) -> None:
        self.local_client = local_client
        self.name = name
        self.segment = segment
        self.remote = remote
        self.period = period
        self.gather = gather
        self.spec: Spec | None = None
        self.state = "waiting"          # waiting, starting, ready, failed, stopped
        #: the cycles run, the forwards (those that found pushes), the pulls
        self.cycles = 0
        self.forwards = 0
        self.pulls = 0
        # when a cycle first saw pushes (asks) it left for later; None: none waits
        self._pushes_wait: float | None = None
        self._asks_wait: float | None = None
        self._local: Buffer | None = None
        self._remote: Buffer | None = None
        # per chunk start: a forwarded delta whose correction is not done
        # yet (the forward failed, or the pull after it): never sent again
        # the workers' push counter as of the last forward, and the pulls asked for that were served
        self._forwarded = 0
        self._served = 0
        self._scratch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._stopping = asyncio.Event()
        self._trouble_since: float | None = None
        self._logged_at = 0.0
        #: why the memory servers fail this mirror now (None: they answer)
        self.trouble: str | None = None

    def __repr__(self) -> str:
        return f"<agent mirror {self.spec if self.spec is not None else self.name!r} {self.state}>"

    def stop(self) -> None:
        """Finish: the running cycle, then one last cycle (what the workers
        pushed so far is forwarded), then :meth:`run` returns."""
        self._stopping.set()

    async def run(self) -> None:
        try:
            await self._take_up()
            await self._start()
            await self._loop()
        except LocalGone:
            log.info("mirror %s stopped: its buffer on the agent's server was removed", self._what())
        except Failed as exc:
            self.state = "failed"
            log.warning("mirror %s failed: %s", self._what(), exc.message)
            try:
                await self._fail(exc.code, exc.message)
            except (LocalGone, InterfaceError, TransportError):
                pass
        except InterfaceError:
            pass        # the agent is stopping: its clients are closed
        except Exception as exc:
            # a fault of the agent's own: the workers are told, not left waiting
            log.exception("mirror %s: the agent failed", self._what())
            self.state = "failed"
            with contextlib.suppress(Exception):
                await self._fail(ErrorCode.INTERNAL, f"the host agent failed on the mirror of {self._what()!r} "
                                                     f"({type(exc).__name__}: {exc}); see its log")
        finally:
            if self.state == "ready":
                log.info("mirror %s stopped after %d cycles", self._what(), self.cycles)
            if self.state != "failed":
                self.state = "stopped"

    # -- taking it up -----------------------------------------------------------
    async def _take_up(self) -> None:
        """Attach the mirror buffer and wait for its creator's description."""
        try:
            local = await self.local_client.attach(self.name)
        except NoSuchBuffer:
            raise LocalGone() from None
        if local.segments[0] != self.segment:
            raise LocalGone()       # made again meanwhile: its own task takes that one up
        local.set_notify_area(STATE, SLOTS)
        self._local = local
        header = np.empty(HEADER, np.uint8)
        while True:
            await self._at_home(local.read_into(header, 0))
            try:
                spec = Spec.decode(header)
            except Unsupported as exc:
                raise Failed(ErrorCode.UNSUPPORTED, f"the mirror buffer {self.name!r}: {exc.message}") from None
            if spec is not None:
                break
            await asyncio.sleep(WAIT_MAGIC)
        self.spec = spec
        self.state = "starting"
        if spec.name != self.name or local.nbytes < buffer_size(spec.nbytes):
            raise Failed(ErrorCode.BAD_REQUEST, f"the mirror buffer {self.name!r} on the agent's server describes "
                                                f"{spec!r}, which is not its region: remove it and open the mirror "
                                                "again")

    async def _start(self) -> None:
        """The checks, then the first cycle; then READY."""
        spec = self.spec
        assert spec is not None
        if spec.wire is not None and (spec.dtype != "float32" or spec.wire not in ("bfloat16", "float16")):
            raise Failed(ErrorCode.UNSUPPORTED,
                         f"the host agent cannot forward buffer {spec.remote!r} as {spec.wire} from {spec.dtype}: a "
                         "narrower wire is bfloat16 or float16, from float32; open the mirror without one")
        if spec.dtype not in DTYPES:
            raise Failed(ErrorCode.UNSUPPORTED,
                         f"the host agent cannot mirror buffer {spec.remote!r} as {spec.dtype}: it forwards "
                         f"{' and '.join(DTYPES)} regions only (their sums are exact there); open the mirror with one "
                         "of them, or push to the memory servers directly")
        itemsize = np.dtype(spec.dtype).itemsize
        if spec.offset % itemsize or spec.nbytes % itemsize:
            raise Failed(ErrorCode.OUT_OF_BOUNDS,
                         f"the mirror of {spec!r}: its offset and size must be multiples of {itemsize} bytes "
                         f"(the size of a {spec.dtype})")
        delay = FIRST_BACKOFF
        while True:
            try:
                remote = await (await self._client()).attach(spec.remote)
                break
            except NoSuchBuffer:
                raise Failed(ErrorCode.NO_SUCH_BUFFER,
                             f"no buffer {spec.remote!r} on the memory servers {', '.join(self.remote.servers)}: "
                             "create it first (or check its name), then open the mirror again") from None
            except BufferDamaged as exc:
                raise Failed(ErrorCode.NO_SUCH_BUFFER,
                             f"buffer {spec.remote!r} on the memory servers is damaged: {exc.message}") from None
            except (TransportError, ServerError) as exc:
                await self._say(0, f"waiting for the memory servers {', '.join(self.remote.servers)}: "
                                   f"{getattr(exc, 'message', exc)}")
                self._trouble(exc, "attaching its buffer")
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF)
        if spec.offset + spec.nbytes > remote.nbytes:
            raise Failed(ErrorCode.OUT_OF_BOUNDS,
                         f"the mirror of {spec!r} runs past the end of buffer {spec.remote!r} ({remote.nbytes} "
                         f"bytes on the memory servers): mirror a region inside it")
        self._remote = remote
        chunk = min(CHUNK, spec.nbytes) // itemsize
        self._scratch = (np.empty(chunk, spec.dtype), np.empty(chunk, spec.dtype), np.empty(chunk, spec.dtype))
        log.info("mirror of %r started: %d bytes, buffer %r on the agent's server", spec, spec.nbytes, self.name)
        delay = FIRST_BACKOFF
        while True:
            try:
                await self._cycle(pull=True)
                break
            except (TransportError, ServerError) as exc:
                self._check_gone(exc)
                await self._say(0, f"waiting for the memory servers {', '.join(self.remote.servers)}: "
                                   f"{getattr(exc, 'message', exc)}")
                self._trouble(exc, "pulling its region")
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF)
        self._recovered()
        await self._say(0, "")
        assert self._local is not None
        await self._at_home(self._local.notify(0, READY))
        self.state = "ready"

    # -- cycling ----------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        delay = FIRST_BACKOFF
        while True:
            last = self._stopping.is_set()
            started = loop.time()
            try:
                await self._cycle(force=last)
            except (TransportError, ServerError) as exc:
                self._check_gone(exc)
                self._trouble(exc, "forwarding")
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF)
                continue
            self._recovered()
            delay = FIRST_BACKOFF
            if last:
                return
            wait = self.period - (loop.time() - started)
            if wait > 0 and not self._stopping.is_set():
                # the next cycle at most every period; at once when stopping
                try:
                    await asyncio.wait_for(self._stopping.wait(), wait)
                except TimeoutError:
                    pass

    async def _cycle(self, *, pull: bool = False, force: bool = False) -> None:
        """Forward the pushes, if the workers pushed since the last forward;
        pull, if a worker asked for a pull since the last (or ``pull``);
        each once the host's workers all did, or ``gather`` after this
        mirror first saw one (at once with ``force``); then raise the cycle
        counter, unless a push was left for later."""
        spec, local = self.spec, self._local
        assert spec is not None and local is not None
        words = await self._at_home(local.read_notify())
        pushed, wanted = int(words[PUSHED_SLOT]), int(words[WANTED_SLOT])
        now = asyncio.get_running_loop().time()
        waiting = False
        if pushed != self._forwarded:
            if force or self._gathered(pushed - self._forwarded, self._pushes_wait, now):
                for a in range(0, spec.nbytes, CHUNK):
                    await self._forward(a, min(spec.nbytes, a + CHUNK))
                self._forwarded, self._pushes_wait = pushed, None
                self.forwards += 1
            else:
                waiting = True
                self._pushes_wait = now if self._pushes_wait is None else self._pushes_wait
        if wanted > self._served:
            if pull or force or self._gathered(wanted - self._served, self._asks_wait, now):
                pull = True
            else:
                self._asks_wait = now if self._asks_wait is None else self._asks_wait
        if pull:
            for a in range(0, spec.nbytes, CHUNK):
                await self._pull(a, min(spec.nbytes, a + CHUNK))
            self._served, self._asks_wait = wanted, None
            self.pulls += 1
            await self._at_home(local.notify(SERVED_SLOT, wanted))
        self.cycles += 1
        if not waiting:     # a raise says every push counted before the cycle began is forwarded
            # every remote accumulate of this cycle is acknowledged by now
            await self._at_home(local.notify_add(CYCLE_SLOT, 1))

    def _gathered(self, count: int, since: float | None, now: float) -> bool:
        """Whether ``count`` pushes (asks) go now: the host's workers' worth,
        or the first of them seen ``gather`` ago."""
        assert self.spec is not None
        return (count >= self.spec.host_workers or self.gather <= 0
                or (since is not None and now - since >= self.gather))

    async def _forward(self, a: int, b: int) -> None:
        """Bytes ``[a, b)`` of the region: the pushes ``D = L - G_base`` go to
        the servers, and ``G_base += D`` (the local data is left as it is:
        it is ``G_base + pushes`` still, the pushes now counted in ``G_base``)."""
        spec, local, remote, scratch = self.spec, self._local, self._remote, self._scratch
        assert spec is not None and local is not None and remote is not None and scratch is not None
        n = (b - a) // np.dtype(spec.dtype).itemsize
        pushed, base, pulled = (s[:n] for s in scratch)
        data_at, base_of, remote_at = HEADER + a, base_at(spec.nbytes) + a, spec.offset + a
        await self._at_home(local.read_into(base, base_of))
        await self._at_home(local.read_into(pushed, data_at))
        np.subtract(pushed, base, out=pushed)            # D
        if not pushed.any():
            return
        if not all(link.open is not None for link in remote.client.links):
            # reconnect by a pull first: a server that is only down costs
            # this forward a retry, not a doubt
            await remote.read_into(pulled, remote_at)
        try:
            await remote.accumulate(remote_at, pushed, wire=spec.wire)
        except BaseException as exc:
            # it may or may not have landed: it is counted in G_base as if it
            # had, so it is never sent again (once or lost, never twice)
            with contextlib.suppress(Exception):
                await local.write(base_of, base + _sent(pushed, spec.wire))
            if not isinstance(exc, asyncio.CancelledError):
                log.warning("mirror %s: a forward of %d bytes failed (%s); whether it reached the memory servers "
                            "is unknown: it is not sent again, so the host's pushes in it count once or are lost, "
                            "never twice", spec, b - a, getattr(exc, "message", exc))
            raise
        # what the servers added: D as rounded for the wire; the rest of D
        # stays in L - G_base, pending for the next forward (error feedback)
        np.add(base, _sent(pushed, spec.wire), out=base)
        await self._at_home(local.write(base_of, base))

    async def _pull(self, a: int, b: int) -> None:
        """Bytes ``[a, b)`` of the region: read the servers' ``G_new``, add
        ``G_new - G_base`` to the local data, ``G_base = G_new``."""
        spec, local, remote, scratch = self.spec, self._local, self._remote, self._scratch
        assert spec is not None and local is not None and remote is not None and scratch is not None
        n = (b - a) // np.dtype(spec.dtype).itemsize
        _, base, pulled = (s[:n] for s in scratch)
        data_at, base_of, remote_at = HEADER + a, base_at(spec.nbytes) + a, spec.offset + a
        await remote.read_into(pulled, remote_at)
        await self._at_home(local.read_into(base, base_of))
        np.subtract(pulled, base, out=base)
        if base.any():
            await self._at_home(local.accumulate(data_at, base))
        await self._at_home(local.write(base_of, pulled))

    # -- saying -----------------------------------------------------------------
    async def _say(self, code: int, message: str) -> None:
        """Write the agent's word (code, message) into the header."""
        assert self._local is not None
        await self._at_home(self._local.write(WORD_AT, encode_word(code, message)))

    async def _fail(self, code: ErrorCode, message: str) -> None:
        if self._local is None:
            return
        await self._say(int(code), message)
        await self._at_home(self._local.notify(0, FAILED))      # after the message: the workers read it then
        await self._at_home(self._local.notify(SERVED_SLOT, SERVED_ALL))     # (a worker waiting for a pull wakes)

    def _check_gone(self, exc: BaseException) -> None:
        """A remote error that means the remote buffer is gone fails the mirror."""
        spec = self.spec
        assert spec is not None
        if isinstance(exc, (NoSuchBuffer, BufferDamaged)):
            what = ("its server restarted without it" if isinstance(exc, StaleHandle)
                    else "it was destroyed, or its server restarted without it")
            raise Failed(ErrorCode.NO_SUCH_BUFFER,
                         f"buffer {spec.remote!r} is gone from the memory servers ({what}): the host agent stopped "
                         f"mirroring it after {self.cycles} cycles; make the buffer again and open a new mirror") \
                from None

    def _trouble(self, exc: BaseException, doing: str) -> None:
        now = time.monotonic()
        self.trouble = f"{doing}: {type(exc).__name__}: {getattr(exc, 'message', exc)}"
        if self._trouble_since is None:
            self._trouble_since = now
        if now - self._logged_at >= LOG_EVERY:
            self._logged_at = now
            log.warning("mirror %s: the memory servers fail while %s (%s: %s); retrying with backoff",
                        self._what(), doing, type(exc).__name__, getattr(exc, "message", exc))

    def _recovered(self) -> None:
        self.trouble = None
        if self._trouble_since is not None:
            log.warning("mirror %s: the memory servers answer again, after %.1f s", self._what(),
                        time.monotonic() - self._trouble_since)
            self._trouble_since = None
            self._logged_at = 0.0

    async def _client(self) -> Client:
        """The agent's client of the memory servers, saying in the header
        why the mirror waits while it is not connected."""
        if self.remote.trouble is not None:
            await self._say(0, f"waiting for the memory servers {', '.join(self.remote.servers)}: "
                               f"{self.remote.trouble}")
        return await self.remote.client()

    async def _at_home(self, op: Awaitable[T]) -> T:
        """An operation on the agent's own server: the buffer gone there
        stops the mirror."""
        try:
            return await op
        except NoSuchBuffer:
            raise LocalGone() from None

    def _what(self) -> Any:
        return self.spec if self.spec is not None else self.name


def _sent(pushed: np.ndarray, wire: str | None) -> np.ndarray:
    """What the servers added of a forward of ``pushed`` as ``wire`` (in
    place: ``pushed`` is scratch); as it is without a wire (float64 too)."""
    return pushed if wire is None else as_wire(pushed, wire, out=pushed)

