"""Replicated buffers, the server's half (docs/design.md, "Replication").

A buffer made with ``replicas=R`` keeps each stripe on R servers
(:mod:`smb2.placement`).  Which servers hold current replicas, and the epoch of
that view, live in the membership service (:mod:`smb2.membership`, etcd): never
decided here.  This module is what one server does with them:

* *primary* (an op with ``FLAG_REPLICATED``, sent by a client to the stripe's
  first member replica): check the op's epoch against the server's view,
  apply it once per (client id, sequence) -- a retry returns the stored
  result -- and forward it, in arrival order, over one link per backup
  (:class:`Outbox`), then answer once every member and joining backup
  applied it (``BACKUP_FAILED`` naming one that did not within 1 s), and
  only within its lease on the view (SERVER_LEASE: a primary paused or cut
  off past it reads the view before it acknowledges anything);
* *backup* (``FLAG_FORWARDED``, from the stripe's primary, on a connection
  that proved the servers' peer token where they have one): the same epoch
  and duplicate checks, apply, answer.  A backup refuses an epoch older than its
  own: a primary cut off from the membership service cannot acknowledge
  anything once its backups learned the view that removed it;
* *rejoin*: a server that is not a member (it restarted, or was removed) makes
  its segments, adds itself to ``joining``, asks each stripe's primary for a
  copy of the stripe (:meth:`Replication.push_stripes`: sent through the same
  ordered stream as the updates, paced by ``--repair-rate``), and moves
  itself into ``members`` once it holds them all;
* *moved copies* (:meth:`MovedCopies.replace`): the copies of a server out
  of the view for ``--replace-after`` s are claimed (CAS) by the member
  chosen for each replica group, kept in a segment laid out as the lost
  server's part, caught up like a rejoin, and marked ready (CAS).

The package: ``cluster`` (:class:`Replication`: the view and its lease, the
replicated ops, rejoin and sync), ``moved`` (:class:`MovedCopies`),
``forwarding`` (the ordered streams to the backups), ``dedup`` (the
duplicate table), ``needs`` (what it needs of the server and its
connections: the :class:`Server` and :class:`Client` protocols).
"""

from .cluster import COPY_CHUNK, MAX_VOUCH_CHAIN, REFRESH_EVERY, SERVER_LEASE, START_WAIT, Replication
from .dedup import (
    DEDUP_CLIENTS,
    DEDUP_ENTRY_BYTES,
    DEDUP_IDLE,
    DEDUP_PER_CLIENT,
    Dedup,
    Entry,
    Record,
    TooManyClients,
    prefix,
)
from .forwarding import FORWARD_TIMEOUT, OUTBOX_HIGH, BufferKey, Outbox, Pending, Stripe, apply_op
from .moved import MovedCopies
from .needs import Client, Server

__all__ = [
    "COPY_CHUNK", "DEDUP_CLIENTS", "DEDUP_ENTRY_BYTES", "DEDUP_IDLE", "DEDUP_PER_CLIENT", "FORWARD_TIMEOUT",
    "MAX_VOUCH_CHAIN", "OUTBOX_HIGH", "REFRESH_EVERY", "SERVER_LEASE", "START_WAIT", "BufferKey", "Client",
    "Dedup", "Entry", "MovedCopies", "Outbox", "Pending", "Record", "Replication", "Server", "Stripe", "TooManyClients",
    "apply_op", "prefix",
]
