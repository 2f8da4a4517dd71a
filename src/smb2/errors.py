"""The one exception tree of smb2.

Two roots under :class:`Smb2Error`, as asyncpg has them: errors a *server*
reported (:class:`ServerError`, a subclass chosen by the wire's error code) and
*misuse* of the API (:class:`InterfaceError`, also a ``ValueError`` where the
argument was bad).  Transport failures (:class:`TransportError`) and malformed
frames (:class:`ProtocolError`) sit beside them.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any


class Smb2Error(Exception):
    """Root of every error smb2 raises.

    ``str(err)`` is the message, then, as asyncpg shows a server's notice,
    a ``DETAIL: ...`` line for ``detail`` and a ``HINT: ...`` line for
    ``hint`` (what to do) where the error has them; ``err.message`` is the
    message alone."""

    def __init__(self, message: str = "", *, detail: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail
        self.hint = hint

    @property
    def message(self) -> str:
        return super().__str__()

    def __str__(self) -> str:
        lines = [self.message]
        if self.detail:
            lines.append(f"DETAIL: {self.detail}")
        if self.hint:
            lines.append(f"HINT: {self.hint}")
        return "\n".join(lines)


def debug_wanted() -> bool:
    """Whether a program that reports an error in a line or two should show
    its traceback too: ``SMB2_DEBUG=1``, or the ``smb2`` logger at DEBUG."""
    return os.environ.get("SMB2_DEBUG", "") not in ("", "0") or logging.getLogger("smb2").isEnabledFor(logging.DEBUG)


class InterfaceError(Smb2Error):
    """The API was used wrongly (closed client, wrong state, ...)."""


class InvalidArgumentError(InterfaceError, ValueError):
    """A bad argument: offset, size, dtype, alignment, name."""


class TransportError(Smb2Error, ConnectionError):
    """A connection failed or a work completion reported an error.

    ``errno`` carries the OS error number where one exists, ``status`` the
    RDMA work-completion status, ``server`` the server's address."""

    def __init__(self, message: str = "", *, errno: int | None = None,
                 status: int | None = None, server: str | None = None,
                 detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, detail=detail, hint=hint)
        self.errno = errno
        self.status = status
        self.server = server


class ProtocolError(Smb2Error):
    """A frame was malformed (bad magic, version, op or length)."""


class PersistenceError(Smb2Error):
    """A data directory or checkpoint file is unreadable, corrupt (checksum
    mismatch) or in use."""


class MembershipError(Smb2Error):
    """The membership service of a replicated cluster (etcd) could not be
    reached or holds something that is not a view."""


class LockTimeout(Smb2Error, TimeoutError):
    """A lock could not be acquired within the timeout."""


class NotifyTimeout(Smb2Error, TimeoutError):
    """A notification slot did not reach the awaited value within the timeout."""


class OperationTimeout(TransportError, TimeoutError):
    """An operation did not complete within its deadline (``timeout=``, or
    the client's ``op_timeout``).  The connection it waited on was reset:
    the next operation reconnects."""


class AgentLost(Smb2Error):
    """The host agent (``smb2-agent``) this worker pushed through stopped or
    restarted: its mirrors, and the pushes it had not forwarded yet, are
    gone with it.  ``agent``: its "host:port"; ``buffer``: the remote buffer
    mirrored; ``pushes``: this worker's pushes through the mirror;
    ``confirmed``: those surely forwarded to the memory servers (the
    agent's forward counter reached two past what this worker saw after
    each was acknowledged); ``uncertain``: the others, which may or may not
    have reached the servers.  The servers' copy is intact, every push on
    it counted once: nothing is ever pushed again, so nothing counts
    twice."""

    def __init__(self, message: str = "", *, agent: str = "", buffer: str = "", pushes: int = 0,
                 confirmed: int = 0, uncertain: int = 0, detail: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, detail=detail, hint=hint)
        self.agent = agent
        self.buffer = buffer
        self.pushes = pushes
        self.confirmed = confirmed
        self.uncertain = uncertain


class AgentTimeout(Smb2Error, TimeoutError):
    """The host agent did not make a mirror ready within the timeout (no
    ``smb2-agent`` serves that address, or it cannot reach the memory
    servers: the message says which)."""


class ErrorCode(enum.IntEnum):
    """Status codes in a reply header; 0 means success."""

    OK = 0
    BAD_REQUEST = 1
    NO_SUCH_BUFFER = 2
    OUT_OF_MEMORY = 3
    ACCESS_DENIED = 4
    OUT_OF_BOUNDS = 5
    STALE_FENCE = 6
    CONFLICT = 7
    VERSION_MISMATCH = 8
    INTERNAL = 9
    TOO_LARGE = 10
    UNSUPPORTED = 11
    # replication (docs/protocol.md, "Replication")
    STALE_EPOCH = 12
    NOT_MEMBER = 13
    BACKUP_FAILED = 14


class ServerError(Smb2Error):
    """The server refused a request; ``code`` is the wire's error code."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "", *, server: str | None = None,
                 detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, detail=detail, hint=hint)
        self.server = server


class BadRequest(ServerError, ProtocolError):
    """A request the server could not parse: an unknown op, a malformed frame or control message."""

    code = ErrorCode.BAD_REQUEST


class NoSuchBuffer(ServerError, LookupError):
    """No buffer of that name on the server (never created, or destroyed)."""

    code = ErrorCode.NO_SUCH_BUFFER


class OutOfMemory(ServerError, MemoryError):
    """The server has no room for the buffer (``--capacity``) or the request (its memory budget)."""

    code = ErrorCode.OUT_OF_MEMORY


class AccessDenied(ServerError, PermissionError):
    """The server wants a token this client did not prove (``--auth-token-file``)."""

    code = ErrorCode.ACCESS_DENIED


class OutOfBounds(ServerError, IndexError):
    """A range past the end of the buffer, or an atomic's word not 8-byte aligned."""

    code = ErrorCode.OUT_OF_BOUNDS


class StaleFence(ServerError):
    """A write fenced by a lock that was lost (its lease ran out, or a newer holder wrote):
    the data was not written."""

    code = ErrorCode.STALE_FENCE


class LockLost(StaleFence):
    """A replicated lock's holder learned that it no longer holds the lock: it
    could not renew it within its lease (its server was lost and the failover
    took longer), or another client passed it on.  The message names the
    lock, the servers, and what was left unprotected; acquire it again."""


class BufferConflict(ServerError):
    """A buffer of that name exists with other parameters (or a lock of that
    name with another lease)."""

    code = ErrorCode.CONFLICT


class StaleHandle(NoSuchBuffer):
    """A :class:`~smb2.Buffer` handle from before its server restarted
    without keeping the buffer (or before the buffer was destroyed or made
    again): the server no longer holds it under the handle's segment, which
    may now belong to another buffer, so nothing is sent.  Attach the
    buffer again.  Raised by the client after a ``lookup``; a
    :class:`NoSuchBuffer`, so code that handles a vanished buffer handles
    this too."""


class BufferDamaged(Smb2Error):
    """Part of a buffer is gone (its server restarted without its data) or
    belongs to another buffer of the same name: ``create`` and ``attach``
    refuse to hand out a buffer that would read zeros (or another buffer's
    bytes) where its data was.  ``name``: the buffer; ``servers``: the
    servers whose part is lost; ``lost_bytes``: how many of its bytes;
    ``ranges()``: the lost byte ranges, in the buffer's offsets;
    ``remains`` (from ``attach``): a :class:`~smb2.Buffer` of the parts
    that are left, to read what is not lost (an operation that touches a
    lost range raises :class:`NoSuchBuffer`), else None."""

    def __init__(self, message: str = "", *, name: str = "", servers: Sequence[str] = (),
                 parts: Sequence[int] = (), geometry: tuple[int, int, int, int] = (0, 1, 1, 0),
                 detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, detail=detail, hint=hint)
        self.name = name
        self.servers = list(servers)
        #: the lost parts' indices (a part's index is its server's place in the client's list)
        self.parts = list(parts)
        #: (nbytes, stripe, nservers, first): where each stripe of the buffer lives
        self.geometry = geometry
        self.remains: Any = None

    def ranges(self, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
        """The lost byte ranges ``(begin, end)`` within ``[start, end)``,
        adjacent stripes merged, in order."""
        nbytes, stripe, nservers, first = self.geometry
        end = nbytes if end is None else min(end, nbytes)
        lost = set(self.parts)
        run: list[int] | None = None
        for k in range(start // stripe, -(-end // stripe)):
            if (first + k) % nservers in lost:
                lo, hi = max(start, k * stripe), min(end, (k + 1) * stripe)
                if run is not None and run[1] == lo:
                    run[1] = hi
                else:
                    if run is not None:
                        yield run[0], run[1]
                    run = [lo, hi]
        if run is not None:
            yield run[0], run[1]

    @property
    def lost_bytes(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges())


class VersionMismatch(ServerError, ProtocolError):
    """Client and server speak different protocol versions: install one smb2 version on both."""

    code = ErrorCode.VERSION_MISMATCH


class FrameTooLarge(ServerError, ProtocolError):
    """A frame over the server's limit (``--max-frame``): the client cuts requests below it."""

    code = ErrorCode.TOO_LARGE


class Unsupported(ServerError):
    """The server does not offer what was asked (a transport, an op, a dtype)."""

    code = ErrorCode.UNSUPPORTED


class StaleEpoch(ServerError):
    """A replicated op carried an older membership view than the server
    knows (``epoch``: the server's, from the message): read the view again
    and retry with the same op id."""

    code = ErrorCode.STALE_EPOCH


class NotMember(ServerError):
    """The server is not a member of the current view of its replicated
    cluster (it was removed, or is catching up after a restart): send the op
    to the stripe's primary in the current view."""

    code = ErrorCode.NOT_MEMBER


class BackupFailed(ServerError):
    """The primary applied a replicated op but a backup (the message names
    its "host:port") did not answer in time: remove that server from the
    view and retry with the same op id (it is applied once)."""

    code = ErrorCode.BACKUP_FAILED


_BY_CODE: dict[int, type[ServerError]] = {
    cls.code: cls for cls in (BadRequest, NoSuchBuffer, OutOfMemory, AccessDenied,
                              OutOfBounds, StaleFence, BufferConflict,
                              VersionMismatch, FrameTooLarge, Unsupported, StaleEpoch, NotMember,
                              BackupFailed)
}


def server_error(code: int, message: str, server: str | None = None) -> ServerError:
    """The exception for a reply's error code (unknown codes: ServerError)."""
    cls = _BY_CODE.get(code, ServerError)
    err = cls(message, server=server)
    if cls is ServerError:
        err.code = ErrorCode.INTERNAL
    return err
