"""A memory server's connection to another server of its replicated cluster.

The server side may not use the client (the import contracts in
pyproject.toml): this is the little of a client a server needs, on the shared
wire protocol -- hello (naming itself as a ``peer``), the token handshake of
:mod:`smb2.auth`, control messages, and data frames whose replies are handed to
a callback.  One link is one TCP connection; frames go out in the order they
are sent, which is what keeps a backup's copy of a stripe in the primary's
order (replication/forwarding.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, cast

from .. import _core, auth
from ..errors import AccessDenied, TransportError, server_error
from ..protocol import (
    CLOSED,
    FLAG_REPLY,
    H_FLAGS,
    H_LENGTH,
    H_REQUEST,
    H_STATUS,
    INLINE,
    VERSION,
    Destination,
    FrameReceiver,
    Header,
    Op,
    pack,
    parse_address,
    unpack,
)

log = logging.getLogger("smb2.server.peers")

# a reply's status when the link failed before the peer answered (not a wire code)
LINK_FAILED = -1
# a peer that does not answer hello within this is as good as down
CONNECT_TIMEOUT = 1.0
# bytes queued in a link's socket buffer before it says it is paused (the
# forwarding primary then stops reading the clients that feed it)
LINK_HIGH_WATER = 16 << 20

ReplyCallback = Callable[[int, bytes], None]


class PeerLink(FrameReceiver):
    """One TCP connection to a peer server: ``send`` a frame with a callback
    for its reply, ``control`` for a control message.  When the link fails,
    every callback still waiting gets ``LINK_FAILED`` and the reason."""

    def __init__(self, address: str) -> None:
        super().__init__()
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.server_id = ""
        self._next_rid = 0
        self._waiting: dict[int, ReplyCallback] = {}
        self._closed_why: str | None = None
        # callbacks run when the peer reads again after pause_writing
        self.paused = False
        self.on_drain: list[Callable[[], None]] = []

    @classmethod
    async def open(cls, address: str, me: str, token: bytes | None, peer_token: bytes | None = None,
                   timeout: float = CONNECT_TIMEOUT) -> PeerLink:
        """Connect, say hello as server ``me``, authenticate (with the
        clients' ``token``, then, where the peer asks, proving the servers'
        ``peer_token``); raises TransportError (or the server's refusal)
        when the peer is not there."""
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        link = cls(address)
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: link, host, port)
                hello = await link.control({"cmd": "hello", "version": VERSION, "transports": ["tcp"],
                                            "peer": me})
                await auth.client_handshake(link.control, hello, token, f"server {address}")
                peer_nonce = hello.get("peer_nonce")
                if peer_nonce is not None:
                    if peer_token is None:
                        raise AccessDenied(f"server {address} takes forwarded updates only from a server that "
                                           "proves the peer token, and this one has none",
                                           hint="start every server of the cluster with the same "
                                                f"--peer-token-file (or ${auth.PEER_ENV})")
                    mine = auth.new_nonce()
                    await link.control({"cmd": "peer_auth", "nonce": mine,
                                        "proof": auth.peer_proof(peer_token, peer_nonce, mine, me)})
        except (OSError, TimeoutError) as exc:
            link.close(f"cannot reach {address}: {exc or type(exc).__name__}")
            raise TransportError(f"cannot reach server {address}: {exc or 'timed out'}",
                                 server=address) from None
        except BaseException:
            link.close("handshake failed")
            raise
        link.server_id = str(hello.get("server_id", ""))
        return link

    @property
    def is_open(self) -> bool:
        return self.transport is not None and self._closed_why is None

    def send(self, op: int, flags: int, segment: int, offset: int, parts: Sequence[bytes | memoryview],
             on_reply: ReplyCallback) -> None:
        """Send one request frame (its payload is ``parts``, joined)."""
        if not self.is_open:
            on_reply(LINK_FAILED, (self._closed_why or "not connected").encode())
            return
        self._next_rid = (self._next_rid % 0xFFFFFFFF) + 1      # never 0
        rid = self._next_rid
        n = sum(len(p) for p in parts)
        head = _core.encode_header(VERSION, op, flags, 0, rid, segment, offset, n)
        self._waiting[rid] = on_reply
        assert self.transport is not None
        self.transport.writelines((head, *parts))     # copies what it cannot send now

    async def control(self, msg: dict[str, Any]) -> dict[str, Any]:
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

        def done(status: int, payload: bytes) -> None:
            if not fut.done():
                fut.set_result((status, payload))
        self.send(Op.CONTROL, 0, 0, 0, [pack(msg)], done)
        status, payload = await fut
        if status == LINK_FAILED:
            raise TransportError(f"server {self.address}: {payload.decode(errors='replace')}",
                                 server=self.address)
        try:
            reply = unpack(payload)
        except ValueError:
            reply = {}
        if not isinstance(reply, dict):
            reply = {}
        if status:
            raise server_error(status, str(reply.get("message", "")), server=self.address)
        return reply

    def close(self, why: str) -> None:
        if self._closed_why is None:
            self._closed_why = why
        super().close_with(why)
        if self.transport is not None:
            self.transport.abort()
        self._fail_waiting()

    def _fail_waiting(self) -> None:
        waiting, self._waiting = self._waiting, {}
        why = (self._closed_why or "connection lost").encode()
        for cb in waiting.values():
            cb(LINK_FAILED, why)
        drain, self.on_drain = self.on_drain, []
        for fn in drain:
            fn()

    # -- asyncio -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=LINK_HIGH_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._closed_why is None:
            self._closed_why = f"connection to {self.address} lost" + (f": {exc}" if exc else "")
        self.transport = None
        self._fail_waiting()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        drain, self.on_drain = self.on_drain, []
        for fn in drain:
            fn()

    # -- frames (replies only) -------------------------------------------------
    def payload_size(self, hdr: Header) -> int:
        return hdr[H_LENGTH]

    def on_header(self, hdr: Header, size: int) -> Destination:
        if not hdr[H_FLAGS] & FLAG_REPLY:
            self.close(f"server {self.address} sent a request on a peer link")
            return CLOSED
        return INLINE

    def on_frame(self, hdr: Header, payload: memoryview | None) -> None:
        cb = self._waiting.pop(hdr[H_REQUEST], None)
        if cb is None:
            if hdr[H_REQUEST] == 0 and hdr[H_STATUS]:
                # the peer's last word before it closed the link
                self._closed_why = f"server {self.address} closed the link: {_message(payload)}"
            return
        cb(hdr[H_STATUS], b"" if payload is None else bytes(payload))


def _message(payload: memoryview | None) -> str:
    try:
        msg = unpack(payload or b"")
        return str(msg.get("message", "")) if isinstance(msg, dict) else ""
    except ValueError:
        return ""


def error_message(payload: bytes) -> str:
    """The message of an error reply's payload (empty when there is none)."""
    return _message(memoryview(payload))


