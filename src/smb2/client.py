"""The async API users write against: :func:`connect`, :class:`Client`,
:class:`Buffer`.

A buffer's bytes are striped over all servers of the client (docs/design.md,
"Words": stripe).  Each operation is planned by ``_core.plan`` into at most a few
requests per server (one contiguous segment range each, cut at the
transport's request size) and all of them run concurrently.

Deadlines: every operation takes ``timeout=`` (seconds; default the
client's ``op_timeout``, None for none).  When it passes, the connections
still waited on are reset and :class:`OperationTimeout` is raised; the next
operation reconnects.  Reads, ``stat``, ``buffers`` and ``attach`` are
tried once more on a fresh connection when theirs broke; writes, atomics,
``create`` and ``destroy`` never are.

Stale handles: a :class:`Buffer` remembers which server process (its
``server_id``, random per start) each of its segments came from.  On each
new connection it checks: if the server restarted and did not restore the
buffer from its data directory under the same segment, nothing is sent and
:class:`StaleHandle` says to attach again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np

from . import _core, auth, checkpoint, parts, replication, serverlist, sparse
from . import notify as _notify
from .checks import check_int, check_word, to_signed
from .errors import (
    BufferConflict,
    InterfaceError,
    InvalidArgumentError,
    NoSuchBuffer,
    Smb2Error,
    StaleHandle,
    TransportError,
)
from .lock import REPLICATED_LOCK_BYTES, Fence, Lock, ReplicatedLock, fence_of, replicated_lock_buffer
from .placement import Placement, check_replicas
from .protocol import (
    DEFAULT_MAX_REQUEST,
    DTYPE_CODES,
    MASK64,
    PEEK_READS,
    REPL_PREFIX_SIZE,
    WIRE_CODES,
    narrow_into,
    parse_address,
    widen_into,
)
from .transport import KINDS, Link, MapsSegments, MemoryDomain, Transport

log = logging.getLogger("smb2.client")

DEFAULT_STRIPE = 1 << 20
# The shm fast path: a Buffer's operations on mapped segments, each one
# Cython call (_core.MappedStripes, made by Buffer._serve_mapped).  A copy
# on a mapping never waits, so a deadline cannot pass during one (the
# ``timeout`` is only checked); whatever the mapping cannot do (a server not
# mapped, its connection lost, the buffer destroyed, a bad argument) falls
# through to the general path, which says why.  An atomic's PAUSE: nothing
# was done, let the loop run first; the call after it goes through (else,
# rarely, PAUSE again: the general path does it).  A copy pauses after.
_PAUSE = _core.PAUSE
_COPY_DONE_PAUSE = _core.COPY_DONE_PAUSE
# An atomic's TORN: it was done, but its segment stopped being LIVE
# meanwhile (the server froze it for a save, or destroyed it): whether it
# counts is unknown, so it raises and is never done again.
_TORN = _core.TORN
# the smb2 package's directory: an unclosed client's warning names the first
# frame outside it (the user's code that connected)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def as_wire(values: np.ndarray, wire: str | None, out: np.ndarray | None = None) -> np.ndarray:
    """What the servers add of float32 ``values`` sent by an accumulate with
    ``wire``: rounded to its type as the client rounds them (to nearest,
    ties to even; NaN stays NaN, too large becomes +-inf), back in float32
    (into ``out`` if given).  Lets a sender keep exactly what it sent (error
    feedback)."""
    flat = np.ascontiguousarray(values, dtype=np.float32)
    if out is None:
        out = np.empty(flat.shape, np.float32)
    if wire is None:
        np.copyto(out, flat)
        return out
    if wire not in WIRE_CODES:
        raise InvalidArgumentError(f"wire must be None, {' or '.join(map(repr, WIRE_CODES))}, not {wire!r}")
    narrow = np.empty(flat.size, np.uint16)
    narrow_into(WIRE_CODES[wire], flat, narrow)
    widen_into(WIRE_CODES[wire], narrow, out)
    return out


def _wire_code(wire: Any, values: Any, what: str) -> int:
    """The dtype code of ``wire`` for the float32 array ``values`` that
    ``what`` ("accumulate": its delta, "read_into": its out) moves narrower."""
    code = WIRE_CODES.get(wire) if isinstance(wire, str) else None
    if code is None:
        raise InvalidArgumentError(f"wire must be None, {' or '.join(map(repr, WIRE_CODES))}, not {wire!r}")
    if not isinstance(values, np.ndarray) or values.dtype.name != "float32" or values.dtype.byteorder == ">":
        kind = values.dtype if isinstance(values, np.ndarray) else type(values).__name__
        noun = "delta" if what == "accumulate" else "out"
        raise InvalidArgumentError(f"{what} with wire={wire!r} moves a float32 {noun} narrower (native byte "
                                   f"order), and this one is {kind}: pass a float32 array")
    return code


def _bytes_view(data: Any, *, writable: bool, what: str) -> memoryview:
    """A flat byte view of ``data`` without copying it."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise InvalidArgumentError(f"{what} must be C-contiguous (use np.ascontiguousarray)")
        if writable and not data.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only")
        flat: Any = data.reshape(-1).view(np.uint8)
        return memoryview(flat)
    try:
        mv = memoryview(data)
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must be bytes-like or a numpy array, not {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise InvalidArgumentError(f"{what} must be C-contiguous")
    if writable and mv.readonly:
        raise InvalidArgumentError(f"{what} is read-only")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


class Client:
    """A connection to a cluster of memory servers.  Make it with
    :func:`connect`; close it with ``await client.close()`` or ``async with``."""

    __slots__ = ("_links", "_closed", "_registered", "_created_at", "op_timeout", "lazy", "_views",
                 "__weakref__")

    def __init__(self, links: Sequence[Link], created_at: str = "", op_timeout: float | None = None,
                 lazy: bool = False) -> None:
        #: the deadline of an operation that gives no ``timeout=`` (None: none)
        self.op_timeout = _check_timeout(op_timeout)
        #: servers are connected, and buffers' parts looked up, on first use (``connect(lazy=True)``)
        self.lazy = lazy
        self._links = tuple(links)
        self._closed = False
        self._registered: list[Registration] = []
        # the membership view replicated buffers are routed by (opened on first use)
        self._views: replication.Views | None = None
        #: "file:line" of the code that connected (for the unclosed-client warning)
        self._created_at = created_at or _caller_outside_package()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<smb2.Client {state}, {len(self._links)} servers: {', '.join(self.servers)}>"

    # -- lifecycle --------------------------------------------------------
    @property
    def links(self) -> tuple[Link, ...]:
        """One link per server, in the order that defines the striping
        (read-only: a client's servers never change)."""
        return self._links

    @property
    def servers(self) -> list[str]:
        return [link.label for link in self._links]

    @property
    def transports(self) -> list[str]:
        """The transport in use per server ("tcp", "rdma", "shm"; "-" if not connected)."""
        return [t.name if (t := link.open) is not None else "-" for link in self._links]

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(link.close() for link in self._links), return_exceptions=True)
        if self._views is not None:
            await self._views.close()
        for reg in self._registered:
            reg.close()
        self._registered.clear()

    def register(self, array: Any) -> Registration:
        """Register ``array`` (writable, C-contiguous) with the client's RDMA
        devices, so reads into it and writes from it go zero-copy.

        Close the returned handle (or the client) before freeing the array.
        On TCP-only clients it does nothing, so code stays portable."""
        self.ensure_open()
        view = _bytes_view(array, writable=True, what="array")
        domains: dict[int, MemoryDomain] = {}
        for link in self._links:
            dom = link.transport.memory_domain if link.transport is not None else None
            if dom is not None:
                domains.setdefault(id(dom), dom)
        handles = []
        try:
            for dom in domains.values():
                handles.append((dom, dom.register(view)))
        except OSError as exc:
            for dom, h in handles:
                dom.unregister(h)
            raise TransportError(f"cannot register {len(view)} bytes: {exc}", errno=exc.errno) from None
        reg = Registration(view, handles)
        self._registered.append(reg)
        return reg

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed smb2 client for {self.servers}, connected at {self._created_at}: "
                          "close it (await client.close(), or async with)", ResourceWarning, stacklevel=2)

    def ensure_open(self) -> None:
        """Raise :class:`InterfaceError` if the client is closed."""
        if self._closed:
            raise InterfaceError("the client is closed",
                                 hint="connect again with smb2.connect(...)")

    def deadline(self, timeout: float | None) -> float | None:
        """An operation's ``timeout=`` argument, checked, or the client's default."""
        return self.op_timeout if timeout is None else _check_timeout(timeout)

    async def views(self) -> replication.Views:
        """The membership view of the servers (the one every server named at
        hello), which replicated buffers are routed by; InterfaceError where
        the servers run without a membership service."""
        if self._views is None:
            # what each server said at hello (every link that connected once,
            # in connect: a replicated cluster's down servers did not)
            said = [(link.transport.server_info, link.label) for link in self._links if link.transport is not None]
            self._views = replication.Views.of_servers([i for i, _ in said], [label for _, label in said],
                                                       lambda: self.links)
        return self._views

    async def _each(self, msgs: Iterable[dict[str, Any]], timeout: float | None, *,
                    idempotent: bool) -> list[dict[str, Any]]:
        t = self.deadline(timeout)
        return list(await asyncio.gather(*(_control(link, m, t, idempotent=idempotent)
                                           for link, m in zip(self._links, msgs))))

    # -- buffers ------------------------------------------------------------
    async def create(self, name: str, nbytes: int, *, stripe: int = DEFAULT_STRIPE,
                     replicas: int = 1, recreate_lost: bool = False, timeout: float | None = None) -> Buffer:
        """Create the buffer ``name`` of ``nbytes`` striped over all servers.

        ``replicas=R`` keeps R copies of every stripe on R different servers
        (different zones where the servers declare them, ``smb2-server
        --zone``), so the buffer survives R - 1 lost servers: mutations go
        through each stripe's primary server, which copies them to the
        others before it answers; reads stay one-sided.  It needs servers
        started with ``--membership`` (docs/operations.md, "Replicated
        buffers").  ``R`` is at most the number of servers.

        Idempotent: creating an existing buffer with the same size and stripe
        returns it; other parameters raise :class:`BufferConflict`.  An
        existing buffer is returned only whole: when a part of it is gone
        (its server restarted without its data) or belongs to another
        buffer, :class:`BufferDamaged` names the servers and byte ranges
        lost, and nothing is changed.  ``recreate_lost=True`` makes the
        lost parts again instead, as zeros (the caller rewrites them).

        Part 0 is made first (its identity, random, is the buffer's), then
        the others with that identity, then part 0 is sealed
        (docs/protocol.md, "Buffer identity"): clients creating the same
        buffer at once all take part 0's identity."""
        self.ensure_open()
        _check_name(name)
        nbytes = check_int("nbytes", nbytes, low=1)
        stripe = check_int("stripe", stripe, low=8)
        if stripe % 8:
            raise InvalidArgumentError(f"stripe must be a multiple of 8 bytes, not {stripe}")
        n = len(self._links)
        replicas = check_replicas(replicas, n)
        deadline = self.deadline(timeout)
        layout: dict[str, Any] = {}
        # parts left out of a replicated buffer: on servers out of the view, or not answering (they make
        # theirs when they rejoin, as the members describe the buffer, and catch up)
        away: dict[int, str] = {}
        if replicas > 1:
            views = await self.views()      # refused here where the servers keep no view
            view = await views.current()
            zones = [link.transport.server_info.get("zone") if link.transport is not None else None
                     for link in self._links]
            layout = {"replicas": replicas, "servers": self.servers, "zones": zones}
            placement = Placement.of(name, n, nbytes, stripe, replicas, zones)
            away = {k: "out of the view" for k, s in enumerate(self.servers)
                    if s not in view.members and s not in view.joining}
            replication.check_creatable(name, placement, self.servers, view, away)

        # a lazy client keeps no connection for a part it may never use (a replicated buffer's are
        # attached whole: its connections stay)
        keep = not self.lazy or replicas > 1

        async def make(index: int, buffer_id: str | None, seal: bool = False) -> dict[str, Any]:
            msg = {"cmd": "create", "name": name, "nbytes": nbytes, "stripe": stripe,
                   "nservers": n, "index": index, "buffer_id": buffer_id, "seal": seal, **layout}
            if buffer_id is None:       # a server without identities gave part 0 none
                del msg["buffer_id"]
            return await _control(self._links[index], msg, deadline, idempotent=False, stamp=True, keep=keep)

        infos: list[dict[str, Any] | None] = [None] * n
        made: list[int] = []        # parts this call made: undone if it fails
        try:
            # part 0 first (a replicated buffer's first part that can be made, where part 0's server is away)
            rest = [k for k in range(n) if k not in away]
            failed: dict[int, TransportError] = {}
            while True:
                first = rest.pop(0)
                try:
                    anchor = infos[first] = await make(first, os.urandom(8).hex(), seal=n == 1)
                    break
                except TransportError as exc:
                    if replicas == 1 or not rest:
                        raise
                    failed[first] = exc
            if anchor["created"]:
                made.append(first)
            results = await asyncio.gather(*(make(k, anchor.get("buffer_id")) for k in rest),
                                           return_exceptions=True)
            for k, r in zip(rest, results):
                if isinstance(r, dict):
                    infos[k] = r
                    if r["created"]:
                        made.append(k)
            errors = [r for r in results if isinstance(r, BaseException)]
            if (errors or failed) and replicas > 1 and all(isinstance(e, TransportError) for e in errors):
                # a replicated buffer goes on without the servers it cannot reach, as attach does
                failed.update((k, r) for k, r in zip(rest, results) if isinstance(r, TransportError))
                replication.check_creatable(name, placement, self.servers, view, {*away, *failed})
                for k, err in failed.items():
                    view = await views.stop_using(self.servers[k], view, err.message)
                    away[k] = "unreachable"
            elif errors:
                raise _first_error(errors)
            identity, lost = parts.judge(infos, created_now=[k in made for k in range(n)])
            lost = {k: why for k, why in lost.items() if k not in away}
            if lost:
                if not recreate_lost:
                    raise parts.damaged(name, lost, self.servers, nbytes, stripe)
                for k in lost:
                    if (infos[k] or {}).get("buffer_id") != identity:
                        await _control(self._links[k], {"cmd": "destroy", "name": name}, deadline,
                                       idempotent=False, keep=keep)
                        infos[k] = await make(k, identity, seal=k == 0)
                log.warning("buffer %r: parts %s were lost and are made again as zeros (recreate_lost=True)",
                            name, sorted(lost))
                made.clear()        # what was made now is the buffer's part: kept
            if n > 1 and (infos[0] or {}).get("sealed") is False:
                infos[0] = await make(0, identity, seal=True)      # every part is there
        except BaseException:
            # undo what this call made, so a failed create leaves nothing behind
            await asyncio.gather(*(_control(self._links[k], {"cmd": "destroy", "name": name}, deadline,
                                            idempotent=False, keep=keep) for k in made),
                                 return_exceptions=True)
            raise
        if away:
            log.warning("buffer %r made without its parts on servers %s (%s): degraded until they rejoin",
                        name, ", ".join(self.servers[k] for k in sorted(away)),
                        ", ".join(sorted(set(away.values()))))
            return Buffer(self, name, parts.remains(infos, identity, away))
        return Buffer(self, name, [i for i in infos if i is not None])

    async def attach(self, name: str, *, timeout: float | None = None) -> Buffer:
        """Open an existing buffer by name (from any client of the cluster).

        :class:`NoSuchBuffer` if it does not exist (or is still being
        created); :class:`BufferDamaged` if a part of it is gone or belongs
        to another buffer (see :meth:`create`)."""
        self.ensure_open()
        _check_name(name)
        deadline = self.deadline(timeout)
        if self.lazy and (buf := await self._attach_lazily(name, deadline)) is not None:
            return buf
        results = await asyncio.gather(*(self._look_up(name, k, deadline) for k in range(len(self._links))),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, NoSuchBuffer)]
        infos = [r if isinstance(r, dict) else None for r in results]
        found = [i for i in infos if i is not None]
        unreachable = [k for k, r in enumerate(results) if isinstance(r, TransportError)]
        if errors and len(unreachable) == len(errors) and any((i.get("replicas") or 1) > 1 for i in found):
            # a replicated buffer goes on without the servers it cannot reach
            return await self._attach_without(name, infos, {k: results[k] for k in unreachable})
        if errors and len(unreachable) == len(errors) and not found and self._replicated_cluster():
            # every server that answered has no part, and a buffer has a part on every server: it does not
            # exist (so a replicated one can be created without the servers that are down)
            views = await self.views()
            view = await views.current()
            for k in unreachable:
                err = results[k]
                assert isinstance(err, TransportError)
                view = await views.stop_using(self.servers[k], view, err.message)
            raise next(r for r in results if isinstance(r, NoSuchBuffer))
        if errors:
            raise _first_error(errors)
        if found and len(found) < len(infos):
            # the servers answered at different moments, and a creation (part
            # 0, then the others, then part 0 sealed) may have gone on in
            # between: part 0's server said it had none before a part was
            # made elsewhere, or a part's server said so before part 0 was
            # sealed.  What was seen implies those parts exist now: asked
            # again, a missing part is there unless it is lost (or the buffer
            # is being destroyed)
            missing = [k for k, i in enumerate(infos) if i is None]
            again = await asyncio.gather(*(self._look_up(name, k, deadline) for k in missing), return_exceptions=True)
            if errors := [r for r in again if isinstance(r, BaseException) and not isinstance(r, NoSuchBuffer)]:
                raise _first_error(errors)
            for k, info in zip(missing, again):
                infos[k] = info if isinstance(info, dict) else None
            found = [i for i in infos if i is not None]
        if found:
            identity, lost = parts.judge(infos)
            if lost:
                whole = next(i for i in found if i.get("buffer_id") == identity)
                err = parts.damaged(name, lost, self.servers, whole["nbytes"], whole["stripe"])
                if len(lost) < len(infos):
                    err.remains = Buffer(self, name, parts.remains(infos, identity, lost))
                raise err
        if len(found) < len(infos):
            raise next(r for r in results if isinstance(r, NoSuchBuffer))
        return Buffer(self, name, found)

    async def _look_up(self, name: str, part: int, deadline: float | None) -> dict[str, Any]:
        """Part ``part`` of ``name`` as its server describes it now
        (:class:`NoSuchBuffer` where it has none)."""
        return await _control(self._links[part], {"cmd": "lookup", "name": name}, deadline, idempotent=True,
                              stamp=True)

    async def _attach_lazily(self, name: str, deadline: float | None) -> Buffer | None:
        """A lazy client's :meth:`attach`: the buffer from its part 0 alone
        (the others are looked up on their servers' first use), or None
        where every part must be asked now (a replicated buffer or cluster,
        a lost part 0).  Asks at most the first two servers."""
        first = await self._part_or_none(name, 0, deadline)
        if first is None:
            # part 0 is made first: with part 1 missing too, there is no such buffer (a worker waiting
            # for its creator asks two servers); with part 1 there, part 0 was made before it
            if len(self._links) == 1 or await self._part_or_none(name, 1, deadline) is None:
                raise NoSuchBuffer(f"no buffer named {name!r}", server=self.servers[0])
            first = await self._part_or_none(name, 0, deadline)
            if first is None:
                return None         # lost (or being destroyed): every part says which
        if (first.get("replicas") or 1) > 1 or self._replicated_cluster():
            return None
        if not first.get("sealed"):
            # (asking every server would hand it out once each part exists: a worker waiting for its
            # creator would connect to them all)
            raise NoSuchBuffer(f"buffer {name!r} is still being created", server=self.servers[0],
                               hint="attach it again once its creator's create() returned")
        # part 0 is sealed last: the others exist
        return Buffer(self, name, parts.unseen(first, len(self._links)))

    async def _part_or_none(self, name: str, part: int, deadline: float | None) -> dict[str, Any] | None:
        try:
            return await self._look_up(name, part, deadline)
        except NoSuchBuffer:
            return None

    def _replicated_cluster(self) -> bool:
        """Whether the servers keep a membership view (said at hello)."""
        return any(link.transport is not None and link.transport.server_info.get("membership")
                   for link in self._links)

    async def _attach_without(self, name: str, infos: list[dict[str, Any] | None],
                              failed: dict[int, Any]) -> Buffer:
        """Attach the replicated buffer ``name`` whose servers ``failed``
        (index -> TransportError) cannot be reached: they are taken out of
        the membership view (as a failed operation would), and the buffer
        is handed out if every stripe still has a copy on a member."""
        views = await self.views()
        view = await views.current()
        identity, lost = parts.judge(infos)
        lost = {k: why for k, why in lost.items() if k not in failed}
        whole = next(i for i in infos if i is not None and i.get("buffer_id") == identity)
        if lost:
            raise parts.damaged(name, lost, self.servers, whole["nbytes"], whole["stripe"])
        buf = Buffer(self, name, parts.remains(infos, identity, dict.fromkeys(failed, "unreachable")))
        # every stripe keeps a member copy without them, or none is removed
        # (the last member copy of a stripe is never taken out of the view)
        gone = {self.servers[k] for k in failed}
        without = dataclasses.replace(view, members=tuple(m for m in view.members if m not in gone))
        try:
            for i in range(min(buf.placement.nstripes, buf.placement.nservers)):
                replication.primary(buf, i, without)       # raises where every copy would be lost
        except TransportError as exc:
            raise TransportError(f"{exc.message}, once the servers that do not answer "
                                 f"({', '.join(sorted(gone))}) are left out", hint=exc.hint) from None
        for k, err in failed.items():
            view = await views.stop_using(self.servers[k], view, err.message)
        return buf

    async def destroy(self, name: str, *, timeout: float | None = None) -> bool:
        """Destroy the buffer on every server; True if any server had it.  A
        replicated buffer is destroyed on the servers that are up while the
        others are out of the membership view: those drop their parts when
        they rejoin (no member has the buffer any more)."""
        self.ensure_open()
        _check_name(name)
        t = self.deadline(timeout)
        results = await asyncio.gather(*(_control(link, {"cmd": "destroy", "name": name}, t, idempotent=False,
                                                  keep=not self.lazy)
                                         for link in self._links), return_exceptions=True)
        done = [r for r in results if isinstance(r, dict)]
        failed = [k for k, r in enumerate(results) if not isinstance(r, dict)]
        if failed and all(isinstance(results[k], TransportError) for k in failed) and any(
                (r.get("replicas") or 1) > 1 for r in done):
            away = [self.servers[k] for k in failed]
            if await self._out_of_the_view(away):
                log.warning("buffer %r destroyed on the servers that are up; %s, out of the view, drop their "
                            "parts when they rejoin", name, ", ".join(away))
                return True
        if failed:
            raise _first_error([r for r in results if isinstance(r, BaseException)])
        return any(r.get("destroyed") for r in done)

    async def buffers(self, *, timeout: float | None = None) -> list[str]:
        """Names of the buffers that exist on the cluster.  In a replicated
        cluster, servers that do not answer and are out of the membership
        view are left out (every buffer has a part on every server, so the
        others name them all), as :meth:`destroy` leaves them out."""
        self.ensure_open()
        t = self.deadline(timeout)
        results = await asyncio.gather(*(_control(link, {"cmd": "list"}, t, idempotent=True)
                                         for link in self._links), return_exceptions=True)
        failed = [k for k, r in enumerate(results) if not isinstance(r, dict)]
        if failed and (not all(isinstance(results[k], TransportError) for k in failed) or len(failed) == len(results)
                       or not await self._out_of_the_view([self.servers[k] for k in failed])):
            raise _first_error([r for r in results if isinstance(r, BaseException)])
        names: set[str] = set()
        for r in results:
            if isinstance(r, dict):
                names.update(n for n in r.get("buffers", []) if isinstance(n, str))
        return sorted(names)

    async def _out_of_the_view(self, servers: list[str]) -> bool:
        """Whether the servers are all out of the membership view (False
        where the servers keep none: an unreplicated cluster)."""
        try:
            view = await (await self.views()).current()
        except InterfaceError:
            return False
        return not any(s in view.members or s in view.joining for s in servers)

    async def stat(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Each server's statistics (see ``smb2 stat``)."""
        self.ensure_open()
        return await self._each(({"cmd": "stat"} for _ in self._links), timeout, idempotent=True)

    async def server_stat(self, index: int, *, timeout: float | None = None) -> dict[str, Any]:
        """Server ``index``'s statistics (of :attr:`servers`), asked on this
        client's connection to it, behind what that connection carries."""
        self.ensure_open()
        return await _control(self._links[index], {"cmd": "stat"}, self.deadline(timeout), idempotent=True)

    async def peek(self, reads: Sequence[Sequence[tuple[str, int, int]]], *,
                   timeout: float | None = None) -> list[list[bytes | None]]:
        """A look without attaching, for listings: ``reads[s]`` is
        ``(buffer name, offset in that server's part, length)`` triples for
        server ``s``; the bytes of each (None where the server holds no part
        of that name, or not that range).  One request per server and
        PEEK_READS triples, whatever the number of buffers."""
        self.ensure_open()
        t = self.deadline(timeout)

        async def one(link: Link, triples: Sequence[tuple[str, int, int]]) -> list[bytes | None]:
            out: list[bytes | None] = []
            for at in range(0, len(triples), PEEK_READS):
                chunk = [list(r) for r in triples[at:at + PEEK_READS]]
                reply = await _control(link, {"cmd": "peek", "reads": chunk}, t, idempotent=True)
                out.extend(reply["data"])
            return out
        return list(await asyncio.gather(*(one(link, r) if r else _nothing() for link, r in zip(self._links, reads))))

    # -- checkpoints (checkpoint.py) ------------------------------------------
    async def checkpoint(self, name: str, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Save the whole buffer ``name`` to the file ``path`` (atomically,
        with a header and a SHA-256); returns ``name``, ``nbytes``, ``sha256``."""
        self.ensure_open()
        return await checkpoint.checkpoint(self, name, path)

    async def restore(self, name: str, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Load a checkpoint file into buffer ``name`` (created if missing).
        The checksum is verified first; a buffer of another size or a
        checkpoint of another buffer is refused (InvalidArgumentError)."""
        self.ensure_open()
        return await checkpoint.restore(self, name, path)

    # -- locks ----------------------------------------------------------------
    def lock(self, name: str, **options: Any) -> Lock:
        """A contender for the distributed FIFO lock ``name`` (see
        :class:`smb2.lock.Lock` for ``lease``, ``mode``)."""
        self.ensure_open()
        return Lock(self, name, **options)

    def replicated_lock(self, name: str, replicas: int = 2, *, lease: float | None = None) -> ReplicatedLock:
        """A contender for the FIFO lock ``name`` kept on ``replicas`` servers
        (servers started with ``--membership``), in the replicated buffer
        ``"lock:" + name``: it survives the loss of its server (see
        :class:`smb2.lock.ReplicatedLock`).  A name is used either here or
        with :meth:`lock`, never both."""
        self.ensure_open()
        replicas = check_replicas(replicas, len(self._links))
        words = replicated_lock_buffer(name)

        async def open_words() -> Buffer:
            try:
                return await self.attach(words)
            except NoSuchBuffer:
                return await self.create(words, REPLICATED_LOCK_BYTES, stripe=REPLICATED_LOCK_BYTES,
                                         replicas=replicas)
        return ReplicatedLock(self, name, open_words, replicas=replicas, lease=lease)


async def _nothing() -> list[bytes | None]:
    return []


async def _control(link: Link, msg: dict[str, Any], timeout: float | None, *, idempotent: bool,
                   stamp: bool = False, keep: bool = True) -> dict[str, Any]:
    """A control message to one server under a deadline.  ``stamp``: add
    the answering server process's id (``server_id``) to the reply, for a
    Buffer to check its segments against.  ``keep=False``: a server not
    connected yet is connected for this message alone (``Link.call``)."""
    async def send(t: Transport) -> dict[str, Any]:
        reply = await t.control(msg)
        return {**reply, "server_id": t.server_info.get("server_id")} if stamp else reply
    return await link.call(send, timeout, idempotent=idempotent, what=str(msg.get("cmd")), keep=keep)


def _check_timeout(timeout: Any) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise InvalidArgumentError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    return timeout


def _caller_outside_package() -> str:
    """``file:line`` of the innermost frame outside the smb2 package (the
    user's call that led here); a few frame hops, no traceback object."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _first_error(errors: list[BaseException]) -> BaseException:
    # a server error explains more than "connection refused" on another one
    for e in errors:
        if isinstance(e, Smb2Error) and not isinstance(e, (ConnectionError,)):
            return e
    return errors[0]


class _NotTwice:
    """Every new connection of a client's links (``Link.on_open``):
    :class:`InvalidArgumentError` where another of its links reached the
    same server process, whether ``connect`` connects them all at once or
    lazily.  (Not a method of the Client: the links would keep it alive.)"""

    __slots__ = ("labels", "reached")

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        #: server_id -> the address of the link that reached it first
        self.reached: dict[str, str] = {}

    def __call__(self, opened: Link, t: Transport) -> None:
        sid = t.server_info.get("server_id")
        if not sid:
            return
        # (recorded as it is checked, with no await between: links that connect together see each other)
        first = self.reached.setdefault(sid, opened.label)
        if first != opened.label:
            # (named in the list's order, whichever connected first)
            a, b = sorted((first, opened.label), key=self.labels.index)
            twice = serverlist.listed_twice([(a, sid), (b, sid)])
            assert twice is not None
            raise twice


def _misplaced(client: Client, name: str, pos: int, info: dict[str, Any]) -> InterfaceError:
    return InterfaceError(
        f"buffer {name!r}: server {client.servers[pos]} holds part #{info['index']}, "
        f"but is #{pos} in this client's list: list the servers in the same order "
        "on every client")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name.encode()) > 255:
        raise InvalidArgumentError(f"a buffer name is a non-empty str of at most 255 bytes, not {name!r}")


class Registration:
    """Memory registered by :meth:`Client.register`; ``close()`` (idempotent)
    unregisters it."""

    __slots__ = ("view", "_handles", "_closed")

    def __init__(self, view: memoryview, handles: list[tuple[MemoryDomain, Any]]) -> None:
        self.view = view
        self._handles = handles
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"registered with {len(self._handles)} device(s)"
        return f"<smb2.Registration of {len(self.view)} bytes, {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        handles, self._handles = self._handles, []
        for dom, h in handles:
            dom.unregister(h)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Buffer:
    """A named byte array striped over the client's servers.

    All offsets are byte offsets into the buffer.  Operations spanning
    several servers run on all of them concurrently."""

    __slots__ = ("client", "name", "nbytes", "stripe", "nservers", "first", "segments", "buffer_id",
                 "replicas", "placement", "notify_area", "_incarnations", "_checked", "_mapped")

    def __init__(self, client: Client, name: str, infos: Sequence[dict[str, Any]]) -> None:
        geometry = {(i["nbytes"], i["stripe"], i["nservers"]) for i in infos}
        if len(geometry) != 1:
            raise BufferConflict(f"servers disagree about buffer {name!r}: {sorted(geometry)}")
        nbytes, stripe, nservers = geometry.pop()
        if nservers != len(infos):
            raise InterfaceError(
                f"buffer {name!r} is striped over {nservers} servers; this client has {len(infos)}")
        for pos, info in enumerate(infos):
            if info["index"] != pos:
                raise _misplaced(client, name, pos, info)
        self.client = client
        self.name = name
        self.nbytes: int = nbytes
        self.stripe: int = stripe
        self.nservers: int = nservers
        self.segments: list[int] = [int(i["segment"]) for i in infos]
        #: copies of every stripe (1: unreplicated, today's path)
        self.replicas: int = int(infos[0].get("replicas") or 1)
        #: where each stripe lives (each of its copies, replicated): every
        #: question of which server and which segment offset hold a byte
        self.placement: Placement = Placement.of(name, nservers, nbytes, stripe, self.replicas,
                                                 infos[0].get("zones") if self.replicas > 1 else None)
        #: the server of stripe 0 (the Cython planners take it as h)
        self.first: int = self.placement.first
        #: the identity every part carries (random, made at creation; None
        #: from servers that have none)
        self.buffer_id: str | None = infos[0].get("buffer_id")
        # per server: the process the segment was planned against, and the
        # connection last found to reach it (checked once per connection)
        self._incarnations: list[Any] = [i.get("server_id") for i in infos]
        self._checked: list[Transport | None] = [None if i.get("server_id") is parts.UNSEEN else link.open
                                                 for link, i in zip(client.links, infos)]
        #: (offset, slots) of the notification area, None until designated
        #: (see smb2.notify: every client of the buffer designates the same)
        self.notify_area: tuple[int, int] | None = None
        # the shm fast path: the segments mapped by checked shm transports
        # (made when the first one is; see _serve_mapped)
        self._mapped: _core.MappedStripes | None = None

    def __repr__(self) -> str:
        copies = f", {self.replicas} replicas" if self.replicas > 1 else ""
        return (f"<smb2.Buffer {self.name!r} {self.nbytes} bytes, stripe {self.stripe}, "
                f"{self.nservers} servers{copies}>")

    # -- replication (smb2.replication routes a replicated buffer's operations) --
    @property
    def replicated(self) -> bool:
        """Each stripe has copies on several servers (replicas > 1)."""
        return self.replicas > 1

    @property
    def links(self) -> tuple[Link, ...]:
        return self.client.links

    async def views(self) -> replication.Views:
        return await self.client.views()

    async def degraded(self) -> bool:
        """True while some stripe has fewer copies on member servers than
        ``replicas`` (a server was lost and has not caught up yet); always
        False for replicas=1."""
        if not self.replicated:
            return False
        views = await self.views()
        return replication.degraded(self.placement, self.client.servers, await views.refresh())

    # -- planning -----------------------------------------------------------
    def _range(self, offset: Any, length: int, what: str) -> int:
        offset = check_int("offset", offset, low=0)
        if offset + length > self.nbytes:
            raise InvalidArgumentError(
                f"{what} of {length} bytes at offset {offset} runs past the end of "
                f"buffer {self.name!r} ({self.nbytes} bytes)")
        return offset

    def lock(self, **options: Any) -> Lock:
        """The buffer's own lock (the lock named ``"buffer:" + name``)."""
        return self.client.lock("buffer:" + self.name, **options)

    async def primary_server(self, offset: int) -> str:
        """The server ("host:port") that takes operations on the byte at
        ``offset`` now: its stripe's primary in the current view for a
        replicated buffer, else the one server that holds it."""
        stripe = self._range(offset, 1, "a lookup") // self.stripe
        if not self.replicated:
            return self.links[self.placement.server_of(stripe)].label
        view = await (await self.views()).current()
        return self.links[replication.primary(self, stripe, view)[0]].label

    async def _run(self, what: str, view: memoryview, offset: int, dtype_code: int = 0,
                   fence: tuple[int, int] | None = None, timeout: float | None = None) -> None:
        self.client.ensure_open()
        # The plan is in the buffer's bytes.  A widening accumulate's payload
        # (bf16 for float32) is ``widen`` times shorter than the range it
        # covers: each request sends the payload's matching slices.
        widen = 1
        if dtype_code:
            dst_item, src_item = _core.dtype_sizes(dtype_code)
            widen = dst_item // src_item
        length = len(view) * widen
        if length == 0:
            return
        if self.replicated:
            return await replication.run(self, what, view, offset, length, widen, dtype_code, fence,
                                         self.client.deadline(timeout))
        links = self.client.links
        # one cut for all servers: the smallest any of this client's
        # transports takes (they differ where auto chose shm for some)
        max_request = min((t.max_request for link in links if (t := link.transport) is not None),
                          default=DEFAULT_MAX_REQUEST)
        reqs, pieces = _core.plan(self.nbytes, self.stripe, self.nservers, self.first,
                                  offset, length, max_request)
        if self.client.lazy and await self._connect_first(reqs[r] for r in range(0, len(reqs), 5)):
            return await self._run(what, view, offset, dtype_code, fence, timeout)     # planned for them
        coros = []
        for r in range(0, len(reqs), 5):
            server, seg_off, ln, p0, np_ = reqs[r:r + 5]
            parts = [view[pieces[2 * p] // widen:(pieces[2 * p] + pieces[2 * p + 1]) // widen]
                     for p in range(p0, p0 + np_)]
            coros.append(self._one(what, links[server], server, parts, seg_off, ln // widen, dtype_code, fence,
                                   timeout))
        try:
            if len(coros) == 1:
                await coros[0]
            else:
                await _gather(coros)
        except TransportError as exc:
            raise self._lost(exc) from None

    async def _connect_first(self, servers: Iterable[int]) -> bool:
        """A lazy client connects the servers an operation was planned for
        before it is sent (its requests are cut to their transports' sizes):
        whether any was not connected yet (then plan again)."""
        links = self.client.links
        new = {k for k in servers if links[k].transport is None}
        if not new:
            return False
        try:
            await _gather([links[k].get() for k in new])
        except TransportError as exc:
            raise self._lost(exc) from None
        return True

    def _lost(self, exc: TransportError) -> TransportError:
        """``exc`` from a server of this unreplicated buffer, said in the
        buffer's terms with what to do (the buffer has no other copy)."""
        if exc.server is None or getattr(exc, "buffer", None) is not None:
            return exc
        err = type(exc)(
            f"buffer {self.name!r} lost server {exc.server}: {exc.message}", errno=exc.errno,
            status=exc.status, server=exc.server, detail=exc.detail,
            hint="its stripes on that server have no other copy (replicas=1): restart the server with its "
                 "--data-dir and attach the buffer again (a training job: run it again, it resumes); to go on "
                 "through a lost server, create the buffer with replicas=2 over servers started with "
                 "--membership")
        setattr(err, "buffer", self.name)     # noqa: B010 (worded once, not again by an outer layer)
        return err

    async def _one(self, what: str, link: Link, server: int, parts: list[memoryview],
                   seg_off: int, length: int, dtype_code: int,
                   fence: tuple[int, int] | None = None, timeout: float | None = None) -> None:
        t = link.open
        retry = what == "read"
        deadline = self.client.deadline(timeout)
        if deadline is None and t is not None and t is self._checked[server]:
            # the fast path: a connection already checked, no deadline
            try:
                return await self._request(t, what, server, parts, seg_off, length, dtype_code, fence)
            except TransportError:
                if not retry or not t.closed:
                    raise
                retry = False       # the one retry is the one below

        async def request(t: Transport) -> None:
            await self.check_incarnation(server, t)
            await self._request(t, what, server, parts, seg_off, length, dtype_code, fence)
        await link.call(request, deadline, idempotent=retry, what=f"{what} of buffer {self.name!r}")

    def checked(self, server: int) -> Transport | None:
        """The connection to ``server`` last found to hold this buffer's
        segment (:meth:`check_incarnation`), or None."""
        return self._checked[server]

    async def check_incarnation(self, server: int, t: Transport) -> None:
        """Make sure the connection ``t`` reaches a server process that holds
        this buffer's segment under the id it was planned with: the one the
        handle came from, or a restart of it that restored the buffer from
        its data directory.  :class:`StaleHandle` otherwise."""
        if t is self._checked[server]:
            return
        sid = t.server_info.get("server_id")
        if self._incarnations[server] is parts.UNSEEN:
            await self._first_use(server, t)
        elif sid != self._incarnations[server]:
            stale = StaleHandle(
                f"buffer {self.name!r} was attached before server {self.client.servers[server]} "
                "restarted, and that server no longer holds it under the same segment: this handle "
                "could reach another buffer's memory, so nothing was sent",
                server=self.client.servers[server],
                hint=f"attach it again: buf = await client.attach({self.name!r})")
            try:
                info = await t.control({"cmd": "lookup", "name": self.name})
            except NoSuchBuffer:
                raise stale from None
            same = (info["nbytes"], info["stripe"], info["nservers"], info["index"], info.get("buffer_id"),
                    info.get("restored"), info.get("replicas") or 1) == (
                        self.nbytes, self.stripe, self.nservers, server, self.buffer_id, True, self.replicas)
            if self.replicated and same:
                # a replicated part comes back by catching up from the other copies, under the segment id
                # its server gives it now; the server serves it only once it is a member again
                self.segments[server] = int(info["segment"])
            elif not same or int(info["segment"]) != self.segments[server]:
                raise stale
            self._incarnations[server] = sid
        self._checked[server] = t

    async def _first_use(self, server: int, t: Transport) -> None:
        """Look up the part on ``server`` of a buffer a lazy client attached
        from part 0 alone (``connect(lazy=True)``), and check it is this
        buffer's: :class:`BufferDamaged` where it is gone or another's."""
        try:
            info: dict[str, Any] | None = await t.control({"cmd": "lookup", "name": self.name})
        except NoSuchBuffer:
            info = None
        why = parts.lost_at_first_use(info, self.buffer_id)
        if why is not None:
            raise parts.damaged(self.name, {server: why}, self.client.servers, self.nbytes, self.stripe)
        assert info is not None
        if info["index"] != server:
            raise _misplaced(self.client, self.name, server, info)
        if (info["nbytes"], info["stripe"], info["nservers"]) != (self.nbytes, self.stripe, self.nservers):
            raise BufferConflict(f"servers disagree about buffer {self.name!r}: part 0 has "
                                 f"{(self.nbytes, self.stripe, self.nservers)}, server "
                                 f"{self.client.servers[server]}'s part "
                                 f"{(info['nbytes'], info['stripe'], info['nservers'])}")
        self.segments[server] = int(info["segment"])
        self._incarnations[server] = t.server_info.get("server_id")

    async def _request(self, t: Transport, what: str, server: int, parts: list[memoryview],
                       seg_off: int, length: int, dtype_code: int,
                       fence: tuple[int, int] | None) -> None:
        seg = self.segments[server]
        if what == "read":
            if dtype_code:
                await t.read_narrow(parts, seg, seg_off, length, dtype_code)
            else:
                await t.read_into(parts, seg, seg_off, length)
        elif what == "write":
            if fence is None:
                await t.write(parts, seg, seg_off, length)
            else:
                await t.write_fenced(parts, seg, seg_off, length, *fence)
        elif what == "sparse accumulate":
            # seg_off: the request's base; dtype_code: its flags (sparse.plan)
            await t.accumulate_sparse(parts, seg, seg_off, dtype_code)
        else:
            await t.accumulate(parts, seg, seg_off, length, dtype_code)
        self._serve_mapped(server, t)

    # -- the shm fast path ------------------------------------------------------
    def _serve_mapped(self, server: int, t: Transport) -> None:
        """After an operation on ``t``, the connection checked for this
        handle on ``server``: when ``t`` maps the segment, serve the next
        reads, writes and atomics on it from the mapping, in one Cython call
        each (``_core.MappedStripes``), for as long as ``t`` stays open."""
        if not isinstance(t, MapsSegments) or t is not self._checked[server] or self.replicated:
            return
        if self._mapped is not None and self._mapped.attached(server, t.alive):
            return
        mapping = t.mapping_of(self.segments[server])
        if mapping is None:
            return
        if self._mapped is None:
            self._mapped = _core.MappedStripes(self.nbytes, self.stripe, self.nservers, self.first,
                                               t.yield_every)
            self._mapped.copy_threads = t.copy_threads()
        self._mapped.attach(server, *mapping)

    def _word(self, offset: Any) -> tuple[int, int]:
        offset = self._range(offset, 8, "an atomic")
        if offset % 8:
            raise InvalidArgumentError(f"atomics need an 8-byte aligned offset, not {offset}")
        return self.placement.locate(offset)

    def word_transport(self, offset: int) -> tuple[Transport | None, int, int]:
        """``(transport, segment, segment offset)`` of the int64 word at
        ``offset``; the transport is None while its server is not connected
        (smb2.notify: a shm transport can sleep on the word).  None for a
        replicated buffer: its waiters poll the primary, which may change."""
        if self.replicated:
            return None, 0, 0
        server, seg_off = self._word(offset)
        t = self.client.links[server].open
        # (only a connection checked for this handle: a lazy client's part may not be looked up yet)
        return (t if t is self._checked[server] else None), self.segments[server], seg_off

    def _torn(self, offset: int) -> TransportError:
        label = self.client.links[self._word(offset)[0]].label
        return TransportError(
            f"an atomic on buffer {self.name!r} at offset {offset} raced with server {label} "
            "stopping to save its memory (or with the buffer's destruction): it may not have been kept",
            server=label, hint="the server starts again with every acknowledged operation; "
            "read the word after reconnecting before you retry")

    async def _replicated_atomic(self, offset: Any, what: str, operands: bytes, timeout: float | None) -> int:
        self.client.ensure_open()
        offset = self._range(offset, 8, "an atomic")
        if offset % 8:
            raise InvalidArgumentError(f"atomics need an 8-byte aligned offset, not {offset}")
        return to_signed(await replication.atomic(self, what, offset, operands, self.client.deadline(timeout)))

    async def _atomic(self, offset: Any, what: str, timeout: float | None,
                      op: Callable[[Transport, int, int], Awaitable[int]]) -> int:
        """``op(transport, segment, segment offset)`` on the word at ``offset``."""
        self.client.ensure_open()       # else a closed client's link would reconnect
        server, seg_off = self._word(offset)
        link = self.client.links[server]
        deadline = self.client.deadline(timeout)
        t = link.open
        try:
            if deadline is None and t is not None and t is self._checked[server]:
                old = await op(t, self.segments[server], seg_off)
                self._serve_mapped(server, t)
                return to_signed(old)

            async def request(t: Transport) -> int:
                await self.check_incarnation(server, t)
                old = await op(t, self.segments[server], seg_off)
                self._serve_mapped(server, t)
                return old
            return to_signed(await link.call(request, deadline, idempotent=False,
                                             what=f"{what} on buffer {self.name!r}"))
        except TransportError as exc:
            raise self._lost(exc) from None

    # -- data operations ------------------------------------------------------
    async def write(self, offset: int, data: Any, *, fence: Lock | ReplicatedLock | Fence | None = None,
                    notify: tuple[int, int] | None = None, timeout: float | None = None) -> None:
        """Store ``data`` (bytes-like or a C-contiguous numpy array) at ``offset``.

        With ``fence`` (a held :class:`Lock`, or a :class:`Fence`), each
        server refuses its part with :class:`StaleFence` if the token no
        longer fences the lock: on the lock's own server, unless it holds
        the lock now; elsewhere, if a newer holder has written there.

        ``notify=(slot, value)`` raises that notification slot to ``value``
        once the data is in place on every server (see :mod:`smb2.notify`).

        Do not modify ``data`` until this returns (it is sent without a copy)."""
        if (mapped := self._mapped) is not None and fence is None and notify is None \
                and (timeout is None or _check_timeout(timeout)) and not self.client._closed:
            if done := mapped.write(data, offset):
                if done == _COPY_DONE_PAUSE:
                    await asyncio.sleep(0)
                return
        view = _bytes_view(data, writable=False, what="data")
        offset = self._range(offset, len(view), "a write")
        slot = _notify.check_notify(self, notify) if notify is not None else None
        await self._run("write", view, offset, fence=None if fence is None else fence_of(fence),
                        timeout=timeout)
        if slot is not None:
            # only now: every server acknowledged its part, so the data is visible
            await _notify.raise_to(self, *slot)

    async def read(self, offset: int, nbytes: int, *, timeout: float | None = None) -> np.ndarray:
        """Return ``nbytes`` from ``offset`` as a new uint8 numpy array."""
        nbytes = check_int("nbytes", nbytes, low=0)
        out = np.empty(nbytes, dtype=np.uint8)
        await self.read_into(out, offset, timeout=timeout)
        return out

    async def read_into(self, out: Any, offset: int = 0, *, wire: str | None = None,
                        timeout: float | None = None) -> None:
        """Fill ``out`` (a writable C-contiguous array) from ``offset``, in place.

        ``wire="bfloat16"`` (or ``"float16"``): ``out`` is float32, and
        gets the buffer's float32 words rounded to that type as
        :func:`as_wire` rounds them (the same values on every transport),
        which a server reached over TCP rounds before they cross the link:
        half the bytes.  (Over shm and RDMA the client reads the words and
        rounds them itself.)"""
        code = 0
        if wire is not None:
            code = _wire_code(wire, out, "read_into")
            if offset % 4:
                raise InvalidArgumentError(f"read_into with wire={wire!r} reads float32 words: offset {offset} "
                                           "is not a multiple of 4")
        if (mapped := self._mapped) is not None and (timeout is None or _check_timeout(timeout)) \
                and not self.client._closed:
            if done := mapped.read_into(out, offset):
                if code:
                    as_wire(out, wire, out=out)
                if done == _COPY_DONE_PAUSE:
                    await asyncio.sleep(0)
                return
        view = _bytes_view(out, writable=True, what="out")
        offset = self._range(offset, len(view), "a read")
        if not code:
            await self._run("read", view, offset, timeout=timeout)
            return
        if self.replicated:
            # (a replicated buffer's reads go through its copies' checks: read the words, round them here)
            await self._run("read", view, offset, timeout=timeout)
            as_wire(out, wire, out=out)
            return
        narrow = np.empty(out.size, np.uint16)
        await self._run("read", _bytes_view(narrow, writable=True, what="out"), offset, code, timeout=timeout)
        widen_into(code, narrow, out)

    async def accumulate(self, offset: int, delta: np.ndarray, *, wire: str | None = None,
                         notify: tuple[int, int] | None = None, timeout: float | None = None) -> None:
        """Server-side ``buffer[offset:...] += delta`` elementwise, as delta's
        dtype (float32, float64, int32, int64).  Atomic per server request with
        respect to other accumulates and writes.

        ``wire="bfloat16"`` (or ``"float16"``) sends a float32 delta in half
        the bytes: it is rounded to that type (to nearest, ties to even; see
        ``_core.to_bfloat16``), and each server upcasts it and adds it into
        the float32 words at ``offset``.  ``notify`` as for :meth:`write`."""
        if not isinstance(delta, np.ndarray):
            raise InvalidArgumentError(f"delta must be a numpy array, not {type(delta).__name__}")
        if wire is None:
            code = DTYPE_CODES.get(delta.dtype.name)
            if code is None or delta.dtype.byteorder == ">":
                raise InvalidArgumentError(
                    f"accumulate supports {', '.join(DTYPE_CODES)} (native byte order), not {delta.dtype}")
        else:
            code = _wire_code(wire, delta, "accumulate")
        view = _bytes_view(delta, writable=False, what="delta")
        offset = self._range(offset, len(view), "an accumulate")
        if offset % delta.itemsize:
            raise InvalidArgumentError(
                f"accumulate of {delta.dtype} needs an offset aligned to {delta.itemsize} bytes, not {offset}")
        if self.stripe % delta.itemsize:
            raise InvalidArgumentError(f"stripe {self.stripe} is not a multiple of {delta.itemsize}")
        slot = _notify.check_notify(self, notify) if notify is not None else None
        if wire is not None:
            narrow = np.empty(delta.size, dtype=np.uint16)
            narrow_into(code, view, narrow)
            view = _bytes_view(narrow, writable=False, what="delta")
        await self._run("accumulate", view, offset, code, timeout=timeout)
        if slot is not None:
            await _notify.raise_to(self, *slot)    # after every server applied its part

    async def accumulate_sparse(self, indices: Any, values: np.ndarray, *, offset: int = 0,
                                wire: str | None = None, notify: tuple[int, int] | None = None,
                                timeout: float | None = None) -> None:
        """Server-side ``buffer.view(float32)[offset // 4 + indices] += values``:
        the float32 words at those element indices (counted from byte
        ``offset``) each take their value, and a duplicate index adds once per
        occurrence (``numpy.add.at``, not ``a[i] += v``).

        ``indices``: a 1-D integer array; ``values``: float32, one per index.
        ``wire="bfloat16"`` (or ``"float16"``) sends the values half as wide,
        as :meth:`accumulate` does.  Each server gets one request (more where
        one would pass the frame size), checked whole before any of it is
        added, and atomic with respect to other accumulates and writes there,
        as a dense accumulate's.  ``notify`` as for :meth:`write`."""
        offset = check_int("offset", offset, low=0)
        idx, sent, code = sparse.check(self.name, self.nbytes, offset, indices, values, wire)
        slot = _notify.check_notify(self, notify) if notify is not None else None
        self.client.ensure_open()
        if len(idx):
            links = self.client.links
            limit = min([DEFAULT_MAX_REQUEST, *(t.max_request for link in links if (t := link.transport) is not None),
                         *(f for link in links if (t := link.transport) is not None
                           and isinstance(f := t.server_info.get("max_frame"), int) and f > 0)])
            if self.replicated:
                limit -= REPL_PREFIX_SIZE
            reqs = sparse.plan(idx, sent, code, offset, stripe=self.stripe, nservers=self.nservers,
                               first=self.first, per_stripe=self.replicated, limit=limit)
            if self.client.lazy and await self._connect_first(r.target for r in reqs):
                return await self.accumulate_sparse(indices, values, offset=offset, wire=wire, notify=notify,
                                                    timeout=timeout)     # planned for them
            if self.replicated:
                await replication.run_sparse(self, reqs, self.client.deadline(timeout))
            else:
                coros = [self._one("sparse accumulate", links[r.target], r.target, r.payload, r.base, r.nbytes,
                                   r.flags, None, timeout) for r in reqs]
                try:
                    await (coros[0] if len(coros) == 1 else _gather(coros))
                except TransportError as exc:
                    raise self._lost(exc) from None
        if slot is not None:
            await _notify.raise_to(self, *slot)    # after every server added its part

    async def fetch_add(self, offset: int, value: int = 1, *, timeout: float | None = None) -> int:
        """Atomically add ``value`` to the int64 word at ``offset`` (8-byte
        aligned); return the word's old value."""
        if (mapped := self._mapped) is not None and (timeout is None or _check_timeout(timeout)) \
                and not self.client._closed:
            old = mapped.fetch_add(offset, value)
            if old is _PAUSE:
                await asyncio.sleep(0)
                old = mapped.fetch_add(offset, value)
            if type(old) is int:
                return old
            if old is _TORN:
                raise self._torn(offset)
        value = check_word("value", value)
        if self.replicated:
            return await self._replicated_atomic(offset, "fetch_add", _core.pack_u64(value & MASK64), timeout)
        return await self._atomic(offset, "fetch_add", timeout,
                                  lambda t, seg, off: t.fetch_add(seg, off, value))

    async def compare_swap(self, offset: int, expected: int, new: int, *,
                           timeout: float | None = None) -> int:
        """Atomically replace the int64 word at ``offset`` with ``new`` if it
        equals ``expected``; return the old value (== expected on success)."""
        if (mapped := self._mapped) is not None and (timeout is None or _check_timeout(timeout)) \
                and not self.client._closed:
            old = mapped.compare_swap(offset, expected, new)
            if old is _PAUSE:
                await asyncio.sleep(0)
                old = mapped.compare_swap(offset, expected, new)
            if type(old) is int:
                return old
            if old is _TORN:
                raise self._torn(offset)
        expected = check_word("expected", expected)
        new = check_word("new", new)
        if self.replicated:
            return await self._replicated_atomic(offset, "compare_swap",
                                                 _core.pack_u64x2(expected & MASK64, new & MASK64), timeout)
        return await self._atomic(offset, "compare_swap", timeout,
                                  lambda t, seg, off: t.compare_swap(seg, off, expected, new))

    # -- notifications (GPI-2 style; the logic lives in smb2.notify) ----------
    def set_notify_area(self, offset: int, slots: int) -> Buffer:
        """Designate ``slots`` int64 notification words at the 8-byte aligned
        ``offset`` of this buffer (slot ``i`` at ``offset + 8*i``).  Every
        client of the buffer must designate the same area; returns self."""
        self.notify_area = _notify.check_area(self, offset, slots)
        return self

    async def notify(self, slot: int, value: int) -> int:
        """Raise ``slot`` to ``max(slot, value)`` now; return its old value.
        Everything this task awaited before is visible to whoever sees it."""
        off = _notify.slot_offset(self, slot)
        return await _notify.raise_to(self, off, check_word("value", value))

    async def notify_add(self, slot: int, value: int = 1) -> int:
        """Add ``value`` to ``slot`` (a counter); return its old value."""
        return await _notify.add(self, _notify.slot_offset(self, slot), check_word("value", value))

    async def read_notify(self, slot: int | None = None) -> Any:
        """The value of ``slot``, or with no slot all slots as an int64 array
        (one read)."""
        if slot is None:
            return await _notify.read_slots(self)
        return await self.fetch_add(_notify.slot_offset(self, slot), 0)

    async def wait_notify(self, slot: int, at_least: int = 1, *, timeout: float | None = None) -> int:
        """Wait until ``slot >= at_least`` and return its value; sleeps on a
        futex over shm, else polls with exponential backoff (50 µs up to
        5 ms).  Raises
        :class:`~smb2.NotifyTimeout` after ``timeout`` seconds."""
        off = _notify.slot_offset(self, slot)
        at_least = check_word("at_least", at_least)
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgumentError(f"timeout must be a non-negative number of seconds, not {timeout!r}")
        return await _notify.wait_word(self, off, at_least, timeout)


async def _gather(coros: list[Any]) -> None:
    """Run all; when one fails, still wait for the others (they use the
    caller's memory), then raise the first error."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def connect(servers: Sequence[str | tuple[str, int]] | str | None = None, *,
                  transport: str | None = None, timeout: float = 10.0,
                  token: str | bytes | None = None, rdma_device: str | None = None,
                  rdma_gid_index: int | None = None, poll: str = "event",
                  op_timeout: float | None = None, lazy: bool = False) -> Client:
    """Connect to the memory servers (``"host:port"`` each; default from the
    environment variable ``SMB2_SERVERS="h:p,h:p"``).

    The order of the servers defines the buffers' striping: every client of a
    cluster must list them in the same order.  ``token`` (default: the
    environment variable ``SMB2_AUTH_TOKEN``) authenticates to servers that
    require it.

    ``transport``: "auto" (shm where the server runs on this host, else
    RDMA where this machine has a usable device and the server offers it,
    else TCP; chosen per server and logged once at INFO), "shm" or "rdma"
    (never fall back: raise TransportError saying what is missing) or "tcp";
    default: the environment variable ``SMB2_TRANSPORT``, else "auto" (so
    that a program that does not choose, such as a training script, can
    be run over another fabric without a change).
    ``rdma_device`` / ``rdma_gid_index`` pick the device and GID (default:
    the first ACTIVE device, its IPv4 RoCE v2 GID);
    ``poll="busy"`` spins on the completion queue while an RDMA operation
    waits (lowest latency, one busy core) instead of sleeping in the loop.

    ``op_timeout``: the deadline in seconds of every operation that gives
    no ``timeout=`` of its own (default None: operations wait as long as
    their connection lives).  ``timeout`` bounds connecting (and
    reconnecting).

    ``lazy=True``: connect to no server now; each is connected on its
    first use, and :meth:`Client.attach` looks up only part 0 of a buffer
    (on the first server), each other part on its server's first use, so
    that a worker that never touches a server never connects to it (a job
    of many workers over many servers, each using a few).  The errors then
    come at first use: an unreachable server, a server listed twice, a lost
    part (:class:`BufferDamaged`).  Replicated buffers are attached whole,
    as without it; a buffer whose creation is under way (part 0 not sealed
    yet) raises :class:`NoSuchBuffer` until it is done.  :meth:`Client.create`
    and :meth:`Client.destroy` reach every server (a buffer has a part on
    each) but keep no connection to one the client does not otherwise use.
    :meth:`Client.register` covers the RDMA devices of the servers
    connected so far.

    Raises :class:`TransportError` if a server cannot be reached (where the
    servers keep a replicated cluster's membership view, only if none can:
    the client goes on without the others, logged on ``smb2.client``, and
    their replicated buffers fail over from them), :class:`AccessDenied`
    if one refuses the token."""
    if isinstance(servers, str):
        servers = [s for s in (p.strip() for p in servers.split(",")) if s]
    if servers is None:
        servers = serverlist.from_environment()
        if not servers:
            raise InterfaceError("no servers given: pass a list or set SMB2_SERVERS=host:port,...")
    if not servers:
        raise InvalidArgumentError("servers must not be empty")
    if poll not in ("event", "busy"):
        raise InvalidArgumentError(f"poll must be 'event' or 'busy', not {poll!r}")
    if transport is None:
        transport = os.environ.get("SMB2_TRANSPORT", "").strip() or "auto"
        if transport not in KINDS:
            raise InvalidArgumentError(f"SMB2_TRANSPORT must be one of {', '.join(KINDS)}, not {transport!r}: "
                                       "fix or unset the environment variable, or pass transport=",
                                       hint="fix or unset the environment variable")
    elif transport not in KINDS:
        raise InvalidArgumentError(f"transport must be one of {', '.join(KINDS)}, not {transport!r}")
    addresses = [parse_address(s) for s in servers]
    if len(set(addresses)) != len(addresses):
        raise InvalidArgumentError(f"a server is listed twice in {list(servers)}")
    secret = auth.as_token(token) if token is not None else auth.token_from_env()
    options = {"token": secret, "rdma_device": rdma_device, "rdma_gid_index": rdma_gid_index,
               "poll": poll}
    links = [Link(a, transport, timeout, options) for a in addresses]
    client = Client(links, _caller_outside_package(), op_timeout, lazy=bool(lazy))
    not_twice = _NotTwice([link.label for link in links])
    for link in links:
        link.on_open = not_twice
    if lazy:
        return client
    try:
        got = await asyncio.gather(*(link.get() for link in links), return_exceptions=True)
        down = {k: r for k, r in enumerate(got) if isinstance(r, BaseException)}
        if down:
            await _go_on_without(client, down)      # (a server listed twice is raised there)
    except BaseException:
        await client.close()
        raise
    return client


async def _go_on_without(client: Client, down: dict[int, BaseException]) -> None:
    """``connect`` reached some servers and not those in ``down``: a
    replicated cluster goes on without them (logged; the view is left as it
    is: an operation or ``attach`` that needs one of them takes it out of
    the view where every stripe keeps a member copy without it, as after a
    failure, and the buffer shows as degraded); otherwise the first error
    is raised."""
    first = next(iter(down.values()))
    reached = [link.transport for link in client._links if link.transport is not None]
    if (not all(isinstance(e, TransportError) for e in down.values()) or not reached
            or any(t.server_info.get("membership") is None for t in reached)):
        raise first
    await client.views()        # the membership service the reached servers name
    for k, err in down.items():
        assert isinstance(err, TransportError)
        log.warning("server %s is unreachable at connect (%s): going on without it (a replicated cluster)",
                    client.servers[k], err.message)
