"""The shm hand-out: segments' file descriptors for clients on this host.

A client that wants to map segments asks over its authenticated connection
(the ``shm_grant`` control command; like every command but hello and auth it
is unreachable before authentication).  The answer is a one-time ticket, the
path of this server's Unix socket and this host's boot id.  The client checks
the boot id (it must be on the same host), connects to the socket, sends the
ticket, and gets back the segments' memfds with ``SCM_RIGHTS``.  A ticket is
good once, for ten seconds, for the segments it was made for, and the fds it
carries were duplicated when it was made: a segment destroyed meanwhile
cannot make the server send a reused fd number.

The socket lives in a directory only this user can enter (mode 0700), and is
itself mode 0600; the ticket is what proves authentication, the directory is
a second wall.  A client that holds a mapping holds a grant as strong as an
RDMA rkey (docs/reliability.md).
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import resource
import socket
import stat
import tempfile
from dataclasses import dataclass

from ..errors import ErrorCode
from ..host import boot_id
from ..protocol import pack
from .memfd import fd_of, state_offset
from .segment import Refused

log = logging.getLogger("smb2.server.shm")

TICKET_SIZE = 16
TICKET_TTL = 10.0
# a claim that sends no ticket for this long is dropped
CLAIM_TIMEOUT = 5.0
# fds one ticket carries (the kernel passes at most 253 in one message)
MAX_SEGMENTS_PER_GRANT = 64
# tickets waiting to be claimed, per server, and per connection that asked:
# an authenticated client that never claims must not make the server hold
# unbounded fds, nor keep other clients from theirs.  At the server's limit
# a new ticket is not refused: the connection holding the most unclaimed
# tickets loses its oldest (a client claims its ticket within a round trip,
# so only hoarded ones are ever old), so however many connections hoard,
# every other one is served.
MAX_PENDING = 256
MAX_PENDING_PER_OWNER = 4
# fds all unclaimed tickets together may hold: a share of what the process
# may open, so that asking for tickets can never leave it unable to accept
# a connection or open a file
FD_SHARE = 4


def default_socket_path(port: int) -> str:
    """``$XDG_RUNTIME_DIR/smb2/<port>-<pid>.sock`` (else under the temporary
    directory, per user).  The pid keeps apart servers on the same port in
    different network namespaces, which share the file system."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "smb2") if runtime else os.path.join(tempfile.gettempdir(),
                                                                        f"smb2-{os.getuid()}")
    return os.path.join(base, f"{port}-{os.getpid()}.sock")


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} must belong to this user and be mode 0700 "
                              f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")


@dataclass
class _Grant:
    segments: list[list[int]]       # [segment id, size, state word offset] per fd
    fds: list[int]
    expiry: asyncio.TimerHandle
    owner: object                   # who asked (the connection)


class ShmService:
    """This server's Unix socket and the tickets waiting to be claimed."""

    def __init__(self, path: str, sock: socket.socket, host_boot_id: str) -> None:
        self.path = path
        self.boot_id = host_boot_id
        self._sock = sock
        self._tickets: dict[bytes, _Grant] = {}
        self._pending_of: dict[object, int] = {}
        self._pending_fds = 0
        self.max_pending_fds = max(MAX_SEGMENTS_PER_GRANT,
                                   resource.getrlimit(resource.RLIMIT_NOFILE)[0] // FD_SHARE)
        self._task: asyncio.Task[None] | None = None
        self._claims: set[asyncio.Task[None]] = set()
        self.handed_out = 0
        # unclaimed tickets expired early to make room for another's (stat)
        self.withdrawn = 0

    @classmethod
    def open(cls, path: str | None, port: int) -> tuple[ShmService | None, str | None]:
        """Listen on the Unix socket: the service, or None and why not."""
        if not hasattr(os, "memfd_create"):
            return None, "this system has no memfd"
        host = boot_id()
        if host is None:
            return None, "this system does not tell its boot id"
        if path is None:
            path = default_socket_path(port)
            _remove_dead_servers_sockets(os.path.dirname(path))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _private_dir(os.path.dirname(path) or ".")
            if os.path.exists(path):
                os.unlink(path)       # a socket left by a killed server
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.listen(64)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            return None, f"cannot listen on {path}: {exc.strerror or exc}"
        return cls(path, sock, host), None

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve())
        log.info("shm: handing out segments on %s", self.path)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for task in list(self._claims):
            task.cancel()
        self._sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        for grant in self._tickets.values():
            grant.expiry.cancel()
            _close_all(grant.fds)
        self._tickets.clear()

    def grant(self, segments: list[tuple[int, memoryview]], owner: object = None) -> dict[str, object]:
        """A ticket for the memfds of ``segments`` ((id, view) each), with
        where to claim it; Refused if there are too many, or one is not
        shareable.  ``owner`` (the asking connection) holds at most
        MAX_PENDING_PER_OWNER unclaimed tickets."""
        if not 0 < len(segments) <= MAX_SEGMENTS_PER_GRANT:
            raise Refused(ErrorCode.BAD_REQUEST, f"shm_grant takes 1..{MAX_SEGMENTS_PER_GRANT} segments")
        if len({sid for sid, _ in segments}) != len(segments):
            raise Refused(ErrorCode.BAD_REQUEST, "shm_grant names a segment twice")
        if self._pending_of.get(owner, 0) >= MAX_PENDING_PER_OWNER:
            raise Refused(ErrorCode.OUT_OF_MEMORY, f"this connection has {MAX_PENDING_PER_OWNER} shm tickets "
                          "waiting to be claimed; claim them first")
        while self._tickets and (len(self._tickets) >= MAX_PENDING
                                 or self._pending_fds + len(segments) > self.max_pending_fds):
            self._withdraw_hoarded()
        fds: list[int] = []
        items = []
        try:
            for sid, view in segments:
                fd = fd_of(view)
                if fd is None:
                    raise Refused(ErrorCode.UNSUPPORTED, f"segment {sid} is not in shareable memory")
                fds.append(os.dup(fd))
                items.append([sid, len(view), state_offset(len(view))])
        except BaseException:
            _close_all(fds)
            raise
        ticket = os.urandom(TICKET_SIZE)
        expiry = asyncio.get_running_loop().call_later(TICKET_TTL, self._expire, ticket)
        self._tickets[ticket] = _Grant(items, fds, expiry, owner)
        self._pending_of[owner] = self._pending_of.get(owner, 0) + 1
        self._pending_fds += len(fds)
        return {"ticket": ticket, "path": self.path, "boot_id": self.boot_id}

    def _withdraw_hoarded(self) -> None:
        """Expire the oldest unclaimed ticket of the connection that holds
        the most (the first of those to ask, on a tie)."""
        most = max(self._pending_of.values())
        ticket = next(t for t, g in self._tickets.items() if self._pending_of[g.owner] == most)
        self.withdrawn += 1
        log.info("shm: %d tickets wait to be claimed; withdrew the oldest of a connection holding %d",
                 len(self._tickets), most)
        self._expire(ticket)

    def drop_owner(self, owner: object) -> None:
        """``owner`` (a connection) closed: its unclaimed tickets go with it."""
        if owner in self._pending_of:
            for ticket in [t for t, g in self._tickets.items() if g.owner is owner]:
                self._expire(ticket)

    def _take(self, ticket: bytes) -> _Grant | None:
        """The grant of ``ticket``, no longer pending (its fds still open)."""
        grant = self._tickets.pop(ticket, None)
        if grant is not None:
            self._pending_fds -= len(grant.fds)
            left = self._pending_of.pop(grant.owner) - 1
            if left:
                self._pending_of[grant.owner] = left
        return grant

    def _expire(self, ticket: bytes) -> None:
        grant = self._take(ticket)
        if grant is not None:
            grant.expiry.cancel()
            _close_all(grant.fds)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                log.warning("shm: accept on %s failed: %s", self.path, exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._claim(conn))
            self._claims.add(task)
            task.add_done_callback(self._claims.discard)

    async def _claim(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        try:
            ticket = b""
            async with asyncio.timeout(CLAIM_TIMEOUT):
                while len(ticket) < TICKET_SIZE:
                    part = await loop.sock_recv(conn, TICKET_SIZE - len(ticket))
                    if not part:
                        return
                    ticket += part
            grant = self._take(ticket)
            if grant is None:
                await loop.sock_sendall(conn, pack({"error": "unknown or expired ticket"}))
                return
            grant.expiry.cancel()
            try:
                # a few hundred bytes into an empty socket buffer: never blocks
                conn.sendmsg([pack({"segments": grant.segments})],
                             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", grant.fds))])
                self.handed_out += len(grant.fds)
            finally:
                _close_all(grant.fds)
        except (OSError, TimeoutError) as exc:
            log.debug("shm: a claim failed: %s", exc)
        finally:
            conn.close()


def _remove_dead_servers_sockets(directory: str) -> None:
    # default sockets are named <port>-<pid>.sock: one whose server process
    # is gone (SIGKILLed, so it could not remove it) is clutter
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        stem, _, pid = name.removesuffix(".sock").rpartition("-")
        if not (name.endswith(".sock") and stem.isdigit() and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
        except OSError:
            pass            # alive, another user's: not ours to judge


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()
