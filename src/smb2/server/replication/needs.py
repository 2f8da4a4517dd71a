"""What the replication needs of the rest of the server, stated as
protocols: its connections (:class:`Client`) and its server (:class:`Server`)."""

from __future__ import annotations

from typing import Any, Protocol

from ...errors import ErrorCode
from ...protocol import Header
from ..segment import Segment


class Client(Protocol):
    """What the replication needs of a server connection (server.connection.Connection):
a duplicate's waiters are answered through it."""

    peer_server: str | None
    host: str

    def reply(self, hdr: Header, payload: bytes | memoryview = b"", status: int = 0,
              flags: int = 0) -> None: ...
    def refuse(self, hdr: Header, code: ErrorCode, message: str, **extra: Any) -> None: ...
    def hold_input(self, reason: str) -> None: ...
    def unhold_input(self, reason: str) -> None: ...


class Server(Protocol):
    """What the replication needs of its server (memory.MemoryServer)."""

    segments: dict[int, Segment]
    by_name: dict[str, Segment]
    restored: set[int]
    restored_clean: bool
    token: bytes | None
    peer_token: bytes | None
    locks: Any
    bytes_in: int
    repair_rate: int
    replace_after: float
    dedup_clients: int

    def create(self, name: str, nbytes: int, stripe: int, nservers: int, index: int,
               buffer_id: str | None = None, seal: bool = False, *, replicas: int = 1,
               servers: list[str] | None = None, zones: list[str | None] | None = None) -> dict[str, Any]: ...
    def destroy(self, name: str) -> dict[str, Any]: ...
    def add_copy(self, of: Segment, index: int) -> Segment: ...
    def drop_copy(self, seg: Segment) -> None: ...
    def add(self, dst: memoryview, delta: memoryview, code: int) -> None: ...
