"""Authentication: a shared token, proven with an HMAC-SHA256 challenge–response
right after ``hello``, in both directions.

    client                                   server (has token T)
    hello {version, ...}               ->
                                       <-    {..., auth: "hmac-sha256", nonce: Ns}
    auth {nonce: Nc,
          proof: HMAC(T, "smb2 client" | Ns | Nc)}  ->
                                       <-    {proof: HMAC(T, "smb2 server" | Ns | Nc)}

The token itself never crosses the wire.  Both nonces are fresh random 32-byte
strings, so a recorded exchange cannot be replayed, and the two proofs carry
different labels, so a server's proof can never be reflected back as a
client's.  The server compares in constant time (``hmac.compare_digest``); a
wrong proof closes the connection.  Until a connection has authenticated, the
server answers only ``hello`` and ``auth``: every other request is refused
with ``ACCESS_DENIED``, so nothing about segments (nor, later, RDMA keys or
addresses) is ever sent to an unauthenticated peer.

This module is shared by the server and every client transport, so a new
transport (RDMA's control connection) authenticates the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Final

from .errors import AccessDenied, InvalidArgumentError, Unsupported

log = logging.getLogger("smb2.auth")

MECH: Final = "hmac-sha256"
NONCE_SIZE: Final = 32
ENV: Final = "SMB2_AUTH_TOKEN"
# the servers' own secret (below): clients never hold it
PEER_ENV: Final = "SMB2_PEER_TOKEN"
# commands a connection may send before it has authenticated (the server's gate)
PUBLIC_COMMANDS: Final = frozenset({"hello", "auth"})
# a token file larger than this is not a token file (a wrong path, a key store)
MAX_TOKEN_FILE: Final = 64 << 10

_CLIENT_LABEL: Final = b"smb2 client\0"
_SERVER_LABEL: Final = b"smb2 server\0"
_PEER_LABEL: Final = b"smb2 peer\0"
_ETCD_LABEL: Final = b"smb2 etcd\0"


def as_token(token: str | bytes | None) -> bytes | None:
    """Normalise a token given by a user: str -> UTF-8, surrounding
    whitespace (a token file's trailing newline) stripped; empty is an error."""
    if token is None:
        return None
    if isinstance(token, str):
        # surrogateescape: an environment variable holding arbitrary bytes round-trips
        token = token.encode("utf-8", "surrogateescape")
    if not isinstance(token, (bytes, bytearray)):
        raise InvalidArgumentError(f"a token is str or bytes, not {type(token).__name__}")
    token = bytes(token).strip()
    if not token:
        raise InvalidArgumentError("the authentication token is empty")
    return token


def token_from_env() -> bytes | None:
    value = os.environ.get(ENV)
    return as_token(value) if value else None


def token_from_file(path: str | os.PathLike[str]) -> bytes:
    """The token in the file at ``path`` (OSError if unreadable).  A file
    over MAX_TOKEN_FILE bytes is an error, not a token cut short; one that
    others may read gets a warning (they could read the token)."""
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        data = f.read(MAX_TOKEN_FILE + 1)
    if len(data) > MAX_TOKEN_FILE:
        raise InvalidArgumentError(f"token file {os.fspath(path)} is over {MAX_TOKEN_FILE} bytes: a token is "
                                   "a short secret (e.g. `openssl rand -hex 32 > FILE`); is this the right file?")
    if mode & 0o044:
        log.warning("token file %s can be read by %s (mode %03o): chmod 600 it", os.fspath(path),
                    "everyone" if mode & 0o004 else "its group", mode & 0o777)
    token = as_token(data)
    assert token is not None
    return token


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, _CLIENT_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, _SERVER_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def peer_proof(peer_token: bytes, server_nonce: bytes, peer_nonce: bytes, name: str) -> bytes:
    """What a server proves, after ``hello`` with ``peer``, to be taken as
    the server ``name`` of a replicated cluster (its forwarded ops are
    applied to a backup's copy).  The peer token is a second secret that
    only the servers hold: the clients' token cannot forge it, so a client
    cannot send a forward that changes one copy of a replicated stripe."""
    return hmac.new(peer_token, _PEER_LABEL + server_nonce + peer_nonce + name.encode(), hashlib.sha256).digest()


def etcd_password(peer_token: bytes, cluster: str) -> str:
    """The password of the servers' etcd user for ``cluster``
    (:func:`smb2.membership.etcd_user`): derived from the peer token, which
    only the servers hold, so no client can read or change the view in etcd
    itself, and one secret is all an operator hands the servers."""
    return hmac.new(peer_token, _ETCD_LABEL + cluster.encode(), hashlib.sha256).hexdigest()


def check(expected: bytes, got: Any) -> bool:
    """Constant-time comparison that tolerates a wrongly typed ``got``."""
    if not isinstance(got, bytes) or len(got) != len(expected):
        # still spend the time of a comparison: no early exit on the type
        hmac.compare_digest(expected, expected)
        return False
    return hmac.compare_digest(expected, got)


async def client_handshake(control: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
                           hello_reply: dict[str, Any], token: bytes | None,
                           label: str) -> dict[str, Any]:
    """Run the client's half after ``hello``; returns what the server said
    on success (merged into the transport's ``server_info``).

    Raises :class:`AccessDenied` when the server wants a token and we have
    none, when the server refuses ours, or when the server cannot prove it
    knows the token itself (a server impersonating the real one)."""
    mech = hello_reply.get("auth")
    if not mech:
        if token is not None:
            # the server runs without authentication: nothing to prove
            log.debug("%s does not ask for authentication", label)
        return {}
    if mech != MECH:
        raise Unsupported(f"{label} asks for authentication mechanism {mech!r}; "
                          f"this client speaks {MECH}", server=label)
    if token is None:
        raise AccessDenied(f"{label} requires authentication: pass token=... to smb2.connect "
                           f"or set {ENV}", server=label)
    server_nonce = hello_reply.get("nonce")
    if not isinstance(server_nonce, bytes) or len(server_nonce) != NONCE_SIZE:
        raise AccessDenied(f"{label} sent a malformed authentication challenge", server=label)
    client_nonce = new_nonce()
    reply = await control({"cmd": "auth", "nonce": client_nonce,
                           "proof": client_proof(token, server_nonce, client_nonce)})
    if not check(server_proof(token, server_nonce, client_nonce), reply.get("proof")):
        raise AccessDenied(f"{label} accepted our token but could not prove it knows it: "
                           "not the server it claims to be", server=label)
    return {k: v for k, v in reply.items() if k != "proof"}
