"""Who holds the replicas of a replicated cluster, and in which epoch.

The view (:class:`View`: an epoch, the member servers, and the copies
moved off lost servers) lives in a coordination service, never in the smb2
servers themselves: a view changes only by a compare-and-set there, so two
servers cut off from each other can never both believe they are the primary
of a stripe in the same epoch.  No
consensus is made here; etcd's is used.

``open_membership("etcd://host:port[,host:port]/cluster-name")`` gives the
view of the cluster named ``cluster-name``, kept at the etcd key
``smb2/<cluster-name>/view``.  etcd 3.4 serves its v3 API as JSON over HTTP
(the gRPC gateway); a small HTTP/1.1 client over ``asyncio.open_connection``
talks to it, so no gRPC stack is needed.  Every request goes to the first
endpoint that answers; a read is linearizable (etcd's default).

Only the servers talk to etcd, as the etcd user ``smb2-<cluster-name>``
(:func:`etcd_user`) whose password they derive from the cluster's peer
token (:func:`smb2.auth.etcd_password`); :func:`setup_auth` makes that user
and role and turns etcd's authentication on.  Clients read and change the
view through a server (docs/reliability.md, "Who can change the view").
"""

from __future__ import annotations

import abc
import asyncio
import base64
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .errors import InvalidArgumentError, MembershipError

log = logging.getLogger("smb2.membership")

SCHEME = "etcd"
# one request to etcd, connection included; a partitioned endpoint is given up
# after this and the next one is tried
REQUEST_TIMEOUT = 2.0
# seconds a request goes on being tried, with backoff, while etcd is slow (a request
# timed out, or etcd answered it has no leader): a busy etcd pauses the callers instead
# of failing their operations.  Not while every endpoint refuses the connection (no
# etcd runs there: said at once).  Waiting is safe: nothing acts on a view until a read
# of it answered (the client's view lease counts from the first try's start).
PATIENCE = 10.0
# the first wait between tries, doubling up to the last
BACKOFF = (0.1, 1.0)
# the largest reply read from etcd (a view is a few hundred bytes)
MAX_REPLY = 1 << 20


@dataclass(frozen=True)
class Substitute:
    """A copy moved off a lost server: the copy that placement puts on
    ``slot`` of every stripe whose replica servers are ``group`` (sorted) is
    held by ``by`` instead, in a segment laid out as ``slot``'s.  ``ready``
    is False while ``by`` catches it up (it receives updates, serves none)."""

    slot: str
    group: tuple[str, ...]
    by: str
    ready: bool = False

    def to_obj(self) -> dict[str, Any]:
        return {"slot": self.slot, "group": list(self.group), "by": self.by, "ready": self.ready}


class Holder(NamedTuple):
    """Who holds one copy of a stripe now: the copy placement puts on
    ``slot`` is on ``server``, which is a ``member`` copy (serves and counts),
    ``joining`` (catching up: receives updates) or ``out``."""

    slot: str
    server: str
    state: str


@dataclass(frozen=True)
class View:
    """One epoch of a replicated cluster's membership."""

    epoch: int                      # grows by exactly 1 at every change; 1 = the first view, 0 = none yet
    members: tuple[str, ...]        # "host:port" of servers that hold current replicas (cluster order)
    joining: tuple[str, ...] = ()   # servers catching up: they receive forwarded updates, serve no reads
    # copies moved off servers lost for longer than --replace-after (see holders)
    replaced: tuple[Substitute, ...] = field(default=(), repr=False)

    def holders(self, group: Sequence[str]) -> list[Holder]:
        """Where each copy of a stripe whose placement puts its replicas on
        the servers ``group`` (replica order) is: the copies still on their
        own servers first, in replica order, then the moved ones; the
        first ``member`` one is the stripe's primary (:meth:`primary`)."""
        key = tuple(sorted(group))
        moved = {s.slot: s for s in self.replaced if s.group == key}
        members, joining = set(self.members), set(self.joining)
        own: list[Holder] = []
        subs: list[Holder] = []
        for slot in group:
            sub = moved.get(slot)
            server = slot if sub is None else sub.by
            if server in members and (sub is None or sub.ready):
                state = "member"
            elif server in members or server in joining:
                state = "joining"
            else:
                state = "out"
            (own if server == slot else subs).append(Holder(slot, server, state))
        return own + subs

    def primary(self, group: Sequence[str]) -> Holder | None:
        """The stripe's first member copy (None: every copy is lost)."""
        return next((h for h in self.holders(group) if h.state == "member"), None)

    def to_json(self) -> bytes:
        obj: dict[str, Any] = {"epoch": self.epoch, "members": list(self.members), "joining": list(self.joining)}
        if self.replaced:
            obj["replaced"] = [s.to_obj() for s in self.replaced]
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> View:
        try:
            obj = json.loads(data)
            view = cls(int(obj["epoch"]), tuple(str(m) for m in obj["members"]),
                       tuple(str(m) for m in obj.get("joining", ())),
                       tuple(Substitute(str(r["slot"]), tuple(str(g) for g in r["group"]), str(r["by"]),
                                        bool(r.get("ready", False))) for r in obj.get("replaced", ())))
        except (ValueError, KeyError, TypeError) as exc:
            raise MembershipError(f"the membership view at {where} is not a view: {data[:200]!r}",
                                  hint="it was written by something other than smb2: delete the key "
                                       "(etcdctl del) and restart the cluster") from exc
        return view


#: the view of a cluster nothing has written yet (its first change writes epoch 1)
NO_VIEW = View(0, ())


class Credentials(NamedTuple):
    """An etcd user and its password (etcd's own authentication)."""

    user: str
    password: str


def etcd_user(cluster: str) -> str:
    """The etcd user (and role) of the servers of ``cluster``: it may read and
    write the keys under ``smb2/<cluster>/`` and nothing else."""
    return f"smb2-{cluster}"


class Membership(abc.ABC):
    """The current view of one replicated cluster, in a coordination service."""

    url: str

    @abc.abstractmethod
    async def view(self) -> View:
        """A linearizable read of the current view (:data:`NO_VIEW` if none was written)."""

    @abc.abstractmethod
    async def change(self, expected: View, *, members: Sequence[str],
                     joining: Sequence[str] = (), replaced: Sequence[Substitute] | None = None) -> View:
        """Compare-and-set on ``expected.epoch``: write epoch + 1 with these members (and
        ``replaced``; None keeps ``expected``'s) if the current epoch is still
        ``expected.epoch``.  Returns the view current afterwards: ours, or the one another
        client wrote first (compare its epoch to know which)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections (the view stays in the service)."""

    async def __aenter__(self) -> Membership:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def parse_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h:p[,h:p]/name`` -> ([(h, p), ...], name) (InvalidArgumentError)."""
    example = "etcd://127.0.0.1:2379/my-cluster (several etcd endpoints: etcd://h1:2379,h2:2379/my-cluster)"
    if not isinstance(url, str) or not url.startswith(SCHEME + "://"):
        raise InvalidArgumentError(f"a membership URL looks like {example}, not {url!r}")
    hosts, _, name = url[len(SCHEME) + 3:].partition("/")
    name = name.strip("/")
    if not name or "/" in name or not name.isprintable() or " " in name:
        raise InvalidArgumentError(f"membership URL {url!r} names no cluster (one path segment): "
                                   f"write it as {example}")
    endpoints = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(f"membership URL {url!r}: {part!r} is not host:port; "
                                       f"write it as {example}")
        endpoints.append((host, int(port)))
    return endpoints, name


def open_membership(url: str, credentials: Credentials | None = None) -> Membership:
    """The membership service ``url`` names (only ``etcd://`` for now), used as
    the etcd user ``credentials`` (None: no etcd authentication).  Nothing is
    connected yet: the first :meth:`Membership.view` does that."""
    endpoints, name = parse_url(url)
    return EtcdMembership(url, endpoints, name, credentials=credentials)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class EtcdMembership(Membership):
    """The view in etcd 3.4+, through its JSON gateway (``/v3/kv/range``, ``/v3/kv/txn``)."""

    def __init__(self, url: str, endpoints: list[tuple[str, int]], name: str,
                 timeout: float = REQUEST_TIMEOUT, patience: float = PATIENCE,
                 credentials: Credentials | None = None) -> None:
        self.url = url
        self.credentials = credentials
        # etcd's token for our user (None: not asked yet, or etcd runs without authentication)
        self._auth_token: str | None = None
        self._auth_off_said = False
        self.patience = patience
        self.endpoints = endpoints
        self.name = name
        self.key = f"smb2/{name}/view".encode()
        self.timeout = timeout
        self._preferred = 0         # the endpoint that answered last

    # -- the view ------------------------------------------------------------
    async def view(self) -> View:
        view, _ = await self._read()
        return view

    async def change(self, expected: View, *, members: Sequence[str],
                     joining: Sequence[str] = (), replaced: Sequence[Substitute] | None = None) -> View:
        new = View(expected.epoch + 1, tuple(members), tuple(joining),
                   expected.replaced if replaced is None else tuple(replaced))
        if not new.members:
            raise InvalidArgumentError("a view needs at least one member",
                                       hint="a replicated cluster with no member server holds no data")
        current, mod_revision = await self._read()
        if current.epoch != expected.epoch:
            return current
        # one txn: put only if the key is still what we read (mod_revision 0 = the key is absent)
        reply = await self._post("/v3/kv/txn", {
            "compare": [{"key": _b64(self.key), "target": "MOD", "mod_revision": str(mod_revision),
                         "result": "EQUAL"}],
            "success": [{"request_put": {"key": _b64(self.key), "value": _b64(new.to_json())}}],
            "failure": [{"request_range": {"key": _b64(self.key)}}],
        })
        if reply.get("succeeded"):
            log.info("membership %s: epoch %d, members %s, joining %s%s", self.name, new.epoch,
                     ",".join(new.members), ",".join(new.joining) or "none",
                     "".join(f"; {s.slot}'s copy of {'+'.join(s.group)} on {s.by}{'' if s.ready else ' (catching up)'}"
                             for s in new.replaced))
            return new
        # another writer came first: its view is in the failure branch's range
        ranged = reply.get("responses", [{}])[0].get("response_range", {})
        return self._decode(ranged)[0]

    async def _read(self) -> tuple[View, int]:
        """The current view and the key's mod_revision (0: no view yet)."""
        return self._decode(await self._post("/v3/kv/range", {"key": _b64(self.key)}))

    def _decode(self, ranged: dict[str, Any]) -> tuple[View, int]:
        kvs = ranged.get("kvs") or []
        if not kvs:
            return NO_VIEW, 0
        kv = kvs[0]
        view = View.from_json(base64.b64decode(kv.get("value", "")), where=f"{self.url} ({self.key.decode()})")
        return view, int(kv.get("mod_revision", 0))

    async def close(self) -> None:
        pass                        # a connection per request: nothing held

    # -- HTTP ----------------------------------------------------------------
    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the first endpoint that answers, starting with the last one that did;
        every endpoint again, with backoff, while etcd is slow (:data:`PATIENCE`)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.patience
        pause = BACKOFF[0]
        tries = 0
        while True:
            tries += 1
            reply, failures, slow = await self._post_once(path, body)
            if reply is not None:
                if tries > 1:
                    log.info("membership %s: etcd answered at try %d", self.name, tries)
                return reply
            if not slow or loop.time() + pause >= give_up:
                break
            log.warning("membership %s: etcd is slow (%s): trying again in %.1f s", self.name,
                        "; ".join(failures), pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, BACKOFF[1])
        raise MembershipError(
            f"the membership service {self.url} did not answer: etcd unreachable"
            + (f" (tried {tries} times in {self.patience:g} s)" if tries > 1 else ""),
            detail="; ".join(failures),
            hint="check that etcd runs at those addresses and that this host can reach them "
                 "(etcdctl --endpoints=HOST:PORT endpoint health); for a test cluster "
                 "LocalCluster(replicated=True) starts its own")

    async def _post_once(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str], bool]:
        """One round over the endpoints: the reply, or None, what each said, and whether
        one was slow (timed out, or had no leader) rather than refused."""
        failures = []
        slow = False
        n = len(self.endpoints)
        for k in range(n):
            i = (self._preferred + k) % n
            host, port = self.endpoints[i]
            try:
                status, reply = await asyncio.wait_for(self._authorized_post(host, port, path, body),
                                                       self.timeout)
            except TimeoutError:
                slow = True
                failures.append(f"{host}:{port}: no answer within {self.timeout:g} s")
                continue
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                failures.append(f"{host}:{port}: {exc!r}")
                continue
            if status == 200:
                self._preferred = i
                return reply, failures, slow
            refusal = str(reply.get("message") or "")
            if any(why in refusal for why in ("permission denied", "user name is empty", "invalid auth token")):
                who = f"etcd user {self.credentials.user}" if self.credentials else "a caller without credentials"
                raise MembershipError(
                    f"etcd at {host}:{port} refused {who} the view of cluster {self.name!r}: {refusal}",
                    hint="only the cluster's servers may read or change its view: start every smb2-server "
                         "with the cluster's --peer-token-file, and run `smb2 etcd-setup` for this cluster "
                         "with that token")
            # etcd's own refusal (no leader: 503 "etcdserver: no leader") -- try the next one
            slow = slow or status == 503
            failures.append(f"{host}:{port}: HTTP {status} {reply.get('message') or reply.get('error')}")
        return None, failures, slow


    async def _authorized_post(self, host: str, port: int, path: str,
                               body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A POST as our etcd user: authenticated first (again when etcd says the
        token expired, which simple tokens do after --auth-token-ttl)."""
        if self.credentials is None:
            return await http_post(host, port, path, body)
        for _ in range(2):
            if self._auth_token is None:
                await self._authenticate(host, port)
            status, reply = await http_post(host, port, path, body, token=self._auth_token)
            if status != 401 or self._auth_token is None:
                return status, reply
            self._auth_token = None         # expired or from a restarted etcd: once more
        return status, reply

    async def _authenticate(self, host: str, port: int) -> None:
        assert self.credentials is not None
        status, reply = await http_post(host, port, "/v3/auth/authenticate",
                                        {"name": self.credentials.user, "password": self.credentials.password})
        if status == 200 and isinstance(reply.get("token"), str):
            self._auth_token = reply["token"]
            return
        message = str(reply.get("message") or reply.get("error") or "")
        if "not enabled" in message:
            # an etcd set up before smb2 asked for authentication: works, but anyone who
            # reaches it can change the view (smb2 doctor says so too)
            if not self._auth_off_said:
                self._auth_off_said = True
                log.warning("membership %s: etcd at %s:%d runs without authentication: anyone who reaches "
                            "it can change the view; turn it on with `smb2 etcd-setup`", self.name, host, port)
            return
        raise MembershipError(
            f"etcd at {host}:{port} refused the servers' credentials for cluster {self.name!r} "
            f"(user {self.credentials.user}): {message or f'HTTP {status}'}",
            hint="the password is derived from the servers' peer token: run `smb2 etcd-setup` with the "
                 "token the servers now use, and give every server the same --peer-token-file")


async def setup_auth(url: str, password: str, root_password: str) -> None:
    """Make etcd at ``url`` require authentication, with the user and role
    :func:`etcd_user` of its cluster (read and write under ``smb2/<cluster>/``
    only, with ``password``) and a ``root`` user (``root_password``, which
    only the operator keeps).  Run once per etcd, before its servers start;
    an etcd whose authentication is already on is left as it is."""
    endpoints, name = parse_url(url)
    host, port = endpoints[0]
    user = etcd_user(name)
    prefix = f"smb2/{name}/".encode()
    steps: list[tuple[str, dict[str, Any]]] = [
        ("/v3/auth/user/add", {"name": "root", "password": root_password}),
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/role/add", {"name": user}),
        # the keys of this cluster: [prefix, prefix with its last byte + 1)
        ("/v3/auth/role/grant", {"name": user, "perm": {"permType": "READWRITE", "key": _b64(prefix),
                                                         "range_end": _b64(prefix[:-1] + b"0")}}),
        ("/v3/auth/user/add", {"name": user, "password": password}),
        ("/v3/auth/user/grant", {"user": user, "role": user}),
        ("/v3/auth/enable", {}),
    ]
    for path, body in steps:
        status, reply = await http_post(host, port, path, body)
        if status != 200:
            message = str(reply.get("message") or reply.get("error") or f"HTTP {status}")
            if "user name is empty" in message or "permission denied" in message:
                log.info("etcd at %s:%d already requires authentication: left as it is", host, port)
                return
            raise MembershipError(f"could not set up etcd's authentication at {host}:{port} ({path}): {message}",
                                  hint="give etcd a fresh data directory, or turn its authentication off "
                                       "(etcdctl --user root auth disable) and run this again")
    log.info("etcd at %s:%d: authentication on, user %s for cluster %s", host, port, user, name)


async def answers_without_credentials(url: str) -> bool:
    """Whether etcd at ``url`` lets anyone read the cluster's view (its
    authentication is off): what ``smb2 doctor`` warns about."""
    endpoints, name = parse_url(url)
    host, port = endpoints[0]
    status, _ = await http_post(host, port, "/v3/kv/range", {"key": _b64(f"smb2/{name}/view".encode())})
    return status == 200


async def http_post(host: str, port: int, path: str, body: dict[str, Any],
                    token: str | None = None) -> tuple[int, dict[str, Any]]:
    """One HTTP/1.1 POST of a JSON body (as the etcd user whose token is
    ``token``); the status and the JSON reply."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        authorization = f"Authorization: {token}\r\n" if token else ""
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"{authorization}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        status_line = await reader.readuntil(b"\r\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP reply: {status_line[:80]!r}")
        headers = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            payload = await _read_chunked(reader)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if length > MAX_REPLY:
                raise ValueError(f"reply of {length} bytes")
            payload = await reader.readexactly(length)
        else:
            payload = await reader.read(MAX_REPLY)
        reply = json.loads(payload) if payload.strip() else {}
        if not isinstance(reply, dict):
            raise ValueError(f"not a JSON object: {payload[:80]!r}")
        return int(parts[1]), reply
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    payload = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(payload)
        if len(payload) + size > MAX_REPLY:
            raise ValueError("reply too large")
        payload += await reader.readexactly(size)
        await reader.readexactly(2)
