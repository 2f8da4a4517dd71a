"""A server connection's control messages: hello, auth, create, lookup,
destroy, stat, the lock names, the RDMA and shm hand-outs, the replicated
cluster's view and sync (docs/protocol.md, "Control messages").

:class:`Control` answers the msgpack maps a :class:`~smb2.server.connection.Connection`
receives as CONTROL frames; it changes the connection through what
:class:`Link` states (greeted, authenticated, its peer server, its RDMA peer).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol

from .. import auth
from ..checks import is_int
from ..errors import ErrorCode
from ..membership import View
from ..protocol import PEEK_BYTES, PEEK_READS, VERSION, Header, pack, parse_address, unpack
from .rdma import STAGING_BYTES
from .replication import Replication
from .segment import Refused

log = logging.getLogger("smb2.server")

MAX_BUFFER_ID = 64        # clients send 16 hex digits


class Link(Protocol):
    """What the control handlers need of their connection (connection.Connection)."""

    server: Any         # the MemoryServer (memory.py)
    peer: str
    host: str
    greeted: bool
    authed: bool
    peer_server: str | None
    rdma_peer: Any
    transport_name: str

    def reply(self, hdr: Header, payload: bytes | memoryview = b"", status: int = 0,
              flags: int = 0) -> None: ...
    def refuse(self, hdr: Header, code: ErrorCode, message: str, **extra: Any) -> None: ...
    def close_with(self, reason: str, hdr: Header | None = None,
                   code: ErrorCode = ErrorCode.BAD_REQUEST, why: str | None = None) -> None: ...
    def count_as(self, transport: str) -> None: ...
    def authenticated(self) -> None: ...


def _comes_from(address: str, source: str) -> bool:
    """May a connection from ``source`` (an IP) be the server ``address``
    ("host:port")?  Checked where the host is an IP literal (a name would
    need a lookup on the loop: it is taken as said)."""
    try:
        host = parse_address(address)[0]
        return ipaddress.ip_address(host) == ipaddress.ip_address(source)
    except ValueError:
        return True


def _str(msg: dict[str, Any], key: str) -> str:
    v = msg.get(key)
    if not isinstance(v, str):
        raise Refused(ErrorCode.BAD_REQUEST, f"control field {key!r} must be a string")
    return v


def _uint(msg: dict[str, Any], key: str) -> int:
    v = msg.get(key)
    if not is_int(v) or not 0 <= v < 1 << 63:
        raise Refused(ErrorCode.BAD_REQUEST, f"control field {key!r} must be a non-negative integer")
    return int(v)


class Control:
    """One connection's control messages: its handshake state (the
    challenge it was sent, the server it says it is) and the handlers."""

    def __init__(self, conn: Link) -> None:
        self.conn = conn
        self.server = conn.server
        self._nonce = b""
        # the server this connection says it is, until it proves it (peer_auth)
        self._peer_claim: str | None = None
        self._peer_nonce = b""

    def handle(self, hdr: Header, payload: memoryview) -> None:
        """Answer one control message (a msgpack map), through its command's handler."""
        try:
            msg = unpack(payload)
        except ValueError as exc:
            raise Refused(ErrorCode.BAD_REQUEST, str(exc)) from None
        if not isinstance(msg, dict):
            raise Refused(ErrorCode.BAD_REQUEST, "a control message is a msgpack map")
        cmd = msg.get("cmd")
        if cmd != "hello" and not self.conn.greeted:
            self.conn.close_with("the first request must be hello", hdr)
            return
        if not self.conn.authed and not (isinstance(cmd, str) and cmd in auth.PUBLIC_COMMANDS):
            # the one gate: whatever a handler adds to the control commands
            # (RDMA keys, addresses) is unreachable before auth
            raise Refused(ErrorCode.ACCESS_DENIED, f"{cmd!r} needs authentication first")
        handler = self._CONTROL.get(cmd) if isinstance(cmd, str) else None
        if handler is None:
            raise Refused(ErrorCode.BAD_REQUEST, f"unknown control command {cmd!r}")
        self.server.controls[str(cmd)] += 1
        result = handler(self, hdr, msg)
        if result is not None:      # None: the handler closed the connection
            self.conn.reply(hdr, pack(result))

    # The control commands (docs/protocol.md): each takes the request's header
    # and message and returns the reply's map, or None after close_with.
    def _cmd_hello(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        srv = self.server
        version = msg.get("version")
        if version != VERSION:
            self.conn.close_with(f"client speaks protocol version {version!r}, server {VERSION}",
                            hdr, ErrorCode.VERSION_MISMATCH)
            return None
        self.conn.greeted = True
        peer = msg.get("peer")
        if isinstance(peer, str):
            # a server of the cluster (replication/ checks it against the
            # view); one that names another host than it comes from is not
            if not _comes_from(peer, self.conn.host):
                srv.warn("peer", "%s says it is server %s: not that server's address, ignored", self.conn.peer, peer)
            elif srv.peer_token is None:
                self.conn.peer_server = peer
            else:
                # taken as that server once it proves the peer token
                self._peer_claim, self._peer_nonce = peer, auth.new_nonce()
        result: dict[str, Any] = {
            "version": VERSION, "server_id": srv.server_id, "capacity": srv.capacity,
            "max_frame": srv.max_frame,
            "transports": srv.transports(),
            # this server takes ACCUMULATE_SPARSE (one without it closes the
            # connection on an op it does not know)
            "sparse": True,
            # a READ may ask float32 words narrowed (protocol.read_span)
            "narrow_read": True}
        if srv.rdma is None:
            result["rdma_off"] = srv.rdma_reason
        if srv.shm is None:
            result["shm_off"] = srv.shm_reason
        if srv.token is None:
            self.conn.authenticated()
            result.update(self._cluster_facts())
        elif not self.conn.authed:
            self._nonce = auth.new_nonce()
            result.update(auth=auth.MECH, nonce=self._nonce)
        if self._peer_claim is not None:
            result["peer_nonce"] = self._peer_nonce
        return result

    def _cmd_peer_auth(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        # behind the authentication gate: a peer authenticates as a client first
        srv = self.server
        claim, self._peer_claim = self._peer_claim, None
        if claim is None or srv.peer_token is None:
            raise Refused(ErrorCode.BAD_REQUEST, "peer_auth follows a hello that names a server (peer)")
        nonce = msg.get("nonce")
        if not (isinstance(nonce, bytes) and len(nonce) == auth.NONCE_SIZE and auth.check(
                auth.peer_proof(srv.peer_token, self._peer_nonce, nonce, claim), msg.get("proof"))):
            srv.warn("peer", "%s says it is server %s and cannot prove the peer token", self.conn.peer, claim)
            self.conn.close_with("peer authentication failed: wrong peer token", hdr, ErrorCode.ACCESS_DENIED,
                            why="auth_failed")
            return None
        self.conn.peer_server = claim
        return {}

    def _with_rdma_keys(self, info: dict[str, Any]) -> dict[str, Any]:
        # a segment's address and key, for clients that read it one-sidedly
        rdma = self.server.rdma
        return {**info, **rdma.segment_info(info["segment"])} if rdma is not None else info

    def _cmd_create(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        buffer_id = _str(msg, "buffer_id") if "buffer_id" in msg else None
        if buffer_id is not None and len(buffer_id) > MAX_BUFFER_ID:
            raise Refused(ErrorCode.BAD_REQUEST, f"a buffer_id is at most {MAX_BUFFER_ID} characters")
        replicas = _uint(msg, "replicas") if "replicas" in msg else 1
        servers, zones = msg.get("servers"), msg.get("zones")
        if replicas > 1 and (not isinstance(servers, list) or not all(isinstance(a, str) for a in servers)
                             or (zones is not None and (not isinstance(zones, list)
                                                        or not all(z is None or isinstance(z, str) for z in zones)))):
            raise Refused(ErrorCode.BAD_REQUEST, "a replicated create names its 'servers' (a list of "
                          "\"host:port\") and optionally their 'zones' (a list of str or None)")
        return self._with_rdma_keys(self.server.create(
            _str(msg, "name"), _uint(msg, "nbytes"), _uint(msg, "stripe"),
            _uint(msg, "nservers"), _uint(msg, "index"), buffer_id, msg.get("seal") is True,
            replicas=replicas, servers=servers, zones=zones))

    def _cmd_lookup(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        repl = self.server.replication
        if "copy_of" in msg and repl is not None:
            # a copy of a lost server's part this server holds in its stead
            return self._with_rdma_keys(repl.moved.lookup_copy(_str(msg, "name"), _str(msg, "copy_of")).info())
        return self._with_rdma_keys(self.server.lookup(_str(msg, "name")))

    def _cmd_rdma_segment(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        seg = self.server.segments.get(_uint(msg, "segment"))
        if seg is None:
            raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {msg['segment']} "
                          "(destroyed, or the server restarted)")
        return self._with_rdma_keys(seg.info())

    def _cmd_rdma_connect(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        srv = self.server
        if srv.rdma is None:
            raise Refused(ErrorCode.UNSUPPORTED, f"this server has no RDMA: {srv.rdma_reason}")
        cap = srv.options.max_rdma_connections
        assert cap is not None
        if self.conn.rdma_peer is None and len(srv.rdma.peers) >= cap:
            # each peer pins a staging area: the memory budget counts them.
            # Said loudly on both sides and counted: the client goes on over
            # TCP, several times slower, and that must not pass unnoticed
            srv.rdma_refused += 1
            srv.warn("rdma_limit", "refused RDMA to %s: this server serves its maximum of %d RDMA connections "
                     "(--max-rdma-connections); that client goes on over TCP", self.conn.peer, cap)
            raise Refused(ErrorCode.OUT_OF_MEMORY,
                          f"server {srv.address[0]}:{srv.address[1]} serves its maximum of {cap} RDMA connections "
                          f"(--max-rdma-connections {cap}, each pinning a {STAGING_BYTES >> 20} MiB staging area): "
                          "raise --max-rdma-connections on that server where its memory allows")
        peer, result = srv.rdma.connect(msg, replacing=self.conn.rdma_peer)
        if not peer.has_staging:
            # the pool of staging areas is lent out: this peer's accumulates
            # come over its TCP connection (correct, slower); said and counted
            srv.rdma_unstaged += 1
            srv.warn("rdma_staging", "RDMA peer %s got no staging area: all %d are lent "
                     "(--rdma-staging-memory %s); its accumulates come in-band over TCP", self.conn.peer,
                     srv.rdma.staging_areas, srv.options.rdma_staging_memory)
        if self.conn.rdma_peer is not None:
            srv.rdma.drop(self.conn.rdma_peer)
        self.conn.rdma_peer = peer
        # from now on this connection's server-side work counts as rdma's
        self.conn.count_as("rdma")
        return result

    def _cmd_shm_grant(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        # behind the authentication gate of _control, like every command here
        srv = self.server
        if srv.shm is None:
            raise Refused(ErrorCode.UNSUPPORTED, f"this server has no shm: {srv.shm_reason}")
        ids = msg.get("segments")
        if not isinstance(ids, list) or not all(is_int(i) for i in ids):
            raise Refused(ErrorCode.BAD_REQUEST, "control field 'segments' must be a list of segment ids")
        segs = []
        for sid in ids:
            seg = srv.segments.get(sid)
            if seg is None:
                raise Refused(ErrorCode.NO_SUCH_BUFFER, f"no segment {sid} (destroyed, or the server restarted)")
            segs.append((seg.id, seg.view))
        # from now on this connection's server-side work counts as shm's
        self.conn.count_as("shm")
        return srv.shm.grant(segs, owner=self.conn)

    def _cmd_repl_sync(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        # a joining server asks for its copies of a buffer's stripes: they go
        # through this server's ordered stream to it; answered when they landed
        repl = self.server.replication
        if repl is None or self.conn.peer_server is None:
            raise Refused(ErrorCode.BAD_REQUEST, "repl_sync is for the servers of a replicated cluster")
        name, epoch, joiner = _str(msg, "name"), _uint(msg, "epoch"), self.conn.peer_server

        async def run() -> None:
            try:
                self.conn.reply(hdr, pack(await repl.serve_sync(joiner, name, epoch)))
            except Refused as exc:
                self.conn.refuse(hdr, exc.code, str(exc), **exc.extra)
            except Exception as exc:
                self.conn.refuse(hdr, ErrorCode.INTERNAL, f"copying to {joiner} failed: {exc}")
        repl.spawn(run())
        return None

    def _cmd_destroy(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.destroy(_str(msg, "name"))

    def _cmd_list(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return {"buffers": sorted(self.server.by_name)}

    def _cmd_stat(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.stat()

    def _cmd_peek(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        """A few bytes of many buffers' parts here, in one request (``smb2
        ls`` reads every buffer's first bytes to tell the stores: one request
        per server, not one per buffer): ``reads`` is [[name, segment
        offset, length], ...]; ``data`` the bytes of each, None where this
        server holds no part of that name or the range is outside it."""
        reads = msg.get("reads")
        if not isinstance(reads, list) or len(reads) > PEEK_READS:
            raise Refused(ErrorCode.BAD_REQUEST, f"peek takes a list of at most {PEEK_READS} reads")
        out: list[bytes | None] = []
        for r in reads:
            if not (isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and is_int(r[1])
                    and is_int(r[2]) and 0 <= r[1] and 0 <= r[2] <= PEEK_BYTES):
                raise Refused(ErrorCode.BAD_REQUEST, f"a peek read is [name, offset, length <= {PEEK_BYTES}]")
            seg = self.server.by_name.get(r[0])
            out.append(None if seg is None or r[1] + r[2] > seg.size else bytes(seg.view[r[1]:r[1] + r[2]]))
        return {"data": out}

    def _cmd_lock_open(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.locks.open(_str(msg, "name"), msg.get("lease"), self.conn)

    def _cmd_lock_close(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.locks.close_name(_str(msg, "name"), self.conn)

    def _cmd_lock_abandon(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        return self.server.locks.abandon(_uint(msg, "offset"), _uint(msg, "ticket"))

    def _cmd_lock_records(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        if self.conn.transport_name != "shm":
            # records are written by the client's own atomics on the mapped
            # lock segment: nobody else can use them
            raise Refused(ErrorCode.BAD_REQUEST, "lock_records is for shm clients (after shm_grant)")
        return self.server.locks.lend_records(self.conn)

    def _cmd_auth(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        srv = self.server
        if srv.token is None:
            raise Refused(ErrorCode.BAD_REQUEST, "this server does not use authentication")
        if self.conn.authed:
            raise Refused(ErrorCode.BAD_REQUEST, "already authenticated")
        # Every proof is checked (one HMAC, about a microsecond): a back-off
        # per source address would lock out the token holders who share the
        # guesser's address.  What a guess costs instead: a connection and a
        # hello for each (one try per challenge), and the token's 2**256
        # possible proofs (docs/operations.md, "What one client can take").
        nonce = msg.get("nonce")
        ok = (isinstance(nonce, bytes) and len(nonce) == auth.NONCE_SIZE
              and auth.check(auth.client_proof(srv.token, self._nonce, nonce), msg.get("proof")))
        if not ok:
            # one try per challenge: a guesser must reconnect for each
            srv.auth_failures += 1
            srv.warn("auth", "authentication failed from %s (wrong token)", self.conn.peer)
            self.conn.close_with("authentication failed: wrong token", hdr, ErrorCode.ACCESS_DENIED, why="auth_failed")
            return None
        assert isinstance(nonce, bytes)
        self.conn.authenticated()
        log.debug("%s authenticated", self.conn.peer)
        return {"proof": auth.server_proof(srv.token, self._nonce, nonce), **self._cluster_facts()}

    def _cluster_facts(self) -> dict[str, Any]:
        """Where this server stands in its replicated cluster: told after
        authentication only (hello to the unauthenticated says nothing of it)."""
        repl = self.server.replication
        return {"membership": repl.url if repl is not None else None,
                "server": repl.me if repl is not None else None,
                "zone": self.server.options.zone,
                "epoch": repl.view.epoch if repl is not None else 0}

    def _cmd_repl_accept(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any]:
        # the operator's word (smb2 repair --accept): this server's copies of
        # stripes no member copy is left of are taken as they are
        repl = self.server.replication
        if repl is None:
            raise Refused(ErrorCode.BAD_REQUEST, "this server is not part of a replicated cluster")
        repl.accept_as_is = True
        log.warning("%s: the operator takes this server's copies of stripes without a member copy as they are",
                    self.conn.peer)
        return {"accepted": True, "stuck": repl.stuck}

    def _cmd_view(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        # clients hold no etcd credentials: they read the view through a server
        self._view_reply(hdr, lambda repl: repl.serve_view())
        return None

    def _cmd_view_change(self, hdr: Header, msg: dict[str, Any]) -> dict[str, Any] | None:
        members, joining = msg.get("members"), msg.get("joining", [])
        if not (isinstance(members, list) and isinstance(joining, list)
                and all(isinstance(m, str) for m in members + joining)):
            raise Refused(ErrorCode.BAD_REQUEST, "view_change takes members and joining as lists of host:port")
        epoch = _uint(msg, "epoch")
        self._view_reply(hdr, lambda repl: repl.serve_change(epoch, members, joining))
        return None

    def _view_reply(self, hdr: Header, work: Callable[[Replication], Awaitable[View]]) -> None:
        repl = self.server.replication
        if repl is None:
            raise Refused(ErrorCode.BAD_REQUEST, "this server is not part of a replicated cluster "
                          "(start it with --membership)")

        async def run() -> None:
            try:
                self.conn.reply(hdr, pack({"view": (await work(repl)).to_json()}))
            except Refused as exc:
                self.conn.refuse(hdr, exc.code, str(exc), **exc.extra)
            except Exception as exc:
                self.conn.refuse(hdr, ErrorCode.INTERNAL, f"the membership service did not answer: {exc}")
        repl.spawn(run())

    _CONTROL: ClassVar[dict[str, Callable[[Control, Header, dict[str, Any]], dict[str, Any] | None]]] = {
        "hello": _cmd_hello, "auth": _cmd_auth, "create": _cmd_create, "lookup": _cmd_lookup,
        "rdma_segment": _cmd_rdma_segment, "rdma_connect": _cmd_rdma_connect, "destroy": _cmd_destroy,
        "list": _cmd_list, "stat": _cmd_stat, "peek": _cmd_peek, "lock_open": _cmd_lock_open,
        "lock_abandon": _cmd_lock_abandon, "shm_grant": _cmd_shm_grant, "lock_close": _cmd_lock_close,
        "lock_records": _cmd_lock_records, "repl_sync": _cmd_repl_sync, "peer_auth": _cmd_peer_auth,
        "view": _cmd_view, "view_change": _cmd_view_change, "repl_accept": _cmd_repl_accept}
