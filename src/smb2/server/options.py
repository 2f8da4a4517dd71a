"""A memory server's options, listed once.

:class:`MemoryServer` and :func:`start_server` take them as keyword arguments
(or a :class:`ServerOptions`), and ``smb2-server`` builds one flag per field
from the field's metadata (``--lock-spin`` for ``lock_spin``), so a new option
is added here and nowhere else.  Every value is checked when the options are
made: a bad one is an :class:`InvalidArgumentError` before anything starts.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from .._core import MAX_THREADS, PARALLEL_ACCUMULATE
from ..errors import InvalidArgumentError
from ..host import usable_cpus
from ..membership import parse_url as parse_membership_url
from ..protocol import DEFAULT_MAX_FRAME, MAX_ACCUMULATE, parse_size
from .locks import DEFAULT_LEASE, DEFAULT_SLOTS, DEFAULT_SPIN, MAX_LEASE, MAX_SLOTS, MAX_SPIN
from .memfd import FDS_PER_SEGMENT, FDS_SPARE, buffers_within_fd_limit, fd_limit
from .metrics import parse_address as parse_metrics_address
from .metrics import prometheus
from .replication import DEDUP_CLIENTS, DEDUP_ENTRY_BYTES, DEDUP_IDLE, DEDUP_PER_CLIENT
from .sizing import DEFAULT_MAX_BUFFERS, MIN_STAGING_AREAS, RDMA_STAGING_BYTES, Sizing, size

log = logging.getLogger("smb2.server")

DEFAULT_WRITE_TIMEOUT = 30.0
# the smallest pool of payload memory: one accumulate of the largest size
# must fit, or it would wait for ever
MIN_RECEIVE_MEMORY = MAX_ACCUMULATE
RDMA_MODES = ("auto", "on", "off")
SHM_MODES = ("auto", "off")
# the smallest part of an accumulate a thread may be given: below it,
# handing the part over costs more than adding it
MIN_THREAD_PART = 1024
# the caps whose default is sized from the machine (sizing.py)
AUTO_CAPS = ("max_connections", "max_connections_per_host", "max_rdma_connections", "rdma_staging_memory")


def _option(default: Any, help: str, *, type: Any = None, metavar: str | None = None,
            choices: tuple[str, ...] | None = None, flag: bool = True, machine: str | None = None) -> Any:
    # the metadata is what smb2-server's argparse flag needs (cli.py);
    # ``help`` may use argparse's %(default)s; ``machine``: the attribute of
    # sizing.Sizing that --help shows as what this machine gives
    return field(default=default, metadata={"help": help, "type": type, "metavar": metavar,
                                            "choices": choices, "flag": flag, "machine": machine})


@dataclass
class ServerOptions:
    """What a memory server is configured with (see each field's help)."""

    capacity: int | str = _option("1GiB", "memory to serve, e.g. 512MiB, 8GiB (default %(default)s)", type=str)
    max_frame: int | str = _option(DEFAULT_MAX_FRAME, "largest payload of one request (default 64MiB)", type=str)
    max_buffers: int = _option(
        DEFAULT_MAX_BUFFERS, f"buffers this server holds at most; each holds {FDS_PER_SEGMENT} file descriptors (its "
        "memfd and its mapping; none with --shm off), so the cap must fit the process's file limit (ulimit -n) "
        "beside --max-connections: checked at start (default %(default)s, lowered to what fits)", type=int,
        machine="buffers_fit")
    # the shared secret clients must prove they know (None: no authentication);
    # smb2-server reads it from --auth-token-file or the environment instead
    token: str | bytes | None = _option(None, "", flag=False)
    # the replicated cluster's servers' own secret, which a server proves to
    # be taken as a peer (auth.peer_proof; None: the source address is all);
    # smb2-server reads it from --peer-token-file or the environment
    peer_token: str | bytes | None = _option(None, "", flag=False)
    data_dir: str | os.PathLike[str] | None = _option(
        None, "save the segments to DIR on SIGTERM/SIGINT and restore them at start", metavar="DIR")
    write_timeout: float = _option(
        DEFAULT_WRITE_TIMEOUT, "close a connection that receives less than --write-min-rate worth of a "
        "request's payload in this many seconds (default %(default)g; 0 = never)", type=float)
    write_min_rate: int | str = _option(
        "64KiB", "bytes per second a request's payload must arrive at, measured over --write-timeout "
        "(default 64KiB)", type=str)
    hello_timeout: float = _option(
        10.0, "close a connection that has not said hello and authenticated within this many seconds "
        "(default %(default)g; 0 = never)", type=float)
    idle_timeout: float = _option(
        3600.0, "close a connection that sent nothing and waits for nothing this many seconds "
        "(default %(default)g; 0 = never)", type=float)
    # None: sized from this machine at start (sizing.py); the help says the value
    max_connections: int | None = _option(
        None, "connections this server holds at most (default: sized at start from the file limit and the "
        "memory: the fewer of half the file limit and the memory beside --capacity over a busy "
        "connection's worst case, halved)", type=int, machine="max_connections")
    max_connections_per_host: int | None = _option(
        None, "connections one source address may hold at most (default: a quarter of --max-connections, at "
        "least 128)", type=int, machine="max_connections_per_host")
    max_rdma_connections: int | None = _option(
        None, "connections that may set up RDMA (a queue pair each); one more is refused RDMA with the reason "
        "and counted (smb2_rdma_refused_total), and its client warns and goes on over TCP (default: "
        "--max-connections)", type=int, machine="max_rdma_connections")
    rdma_staging_memory: int | str | None = _option(
        None, f"pinned memory for the RDMA peers' staging areas, {RDMA_STAGING_BYTES >> 20} MiB each, lent one per "
        "peer while they last: a peer that gets none still reads, writes and does atomics over RDMA, and sends "
        "its accumulates in-band over its TCP connection (counted: smb2_rdma_unstaged_total; its client warns) "
        f"(default: a sixteenth of the memory, at most a quarter of what --capacity leaves, at least "
        f"{MIN_STAGING_AREAS} areas)", type=str,
        machine="rdma_staging_memory")
    max_inflight: int = _option(
        1024, "requests one connection may have waiting for their replies (parked lock acquires, "
        "accumulates behind a write) before the server stops reading it (default %(default)s)", type=int)
    max_reply_bytes: int | str = _option(
        "1MiB", "replies queued for one connection before the server stops reading its requests "
        "(default 1MiB)", type=str)
    max_receive_memory: int | str = _option(
        "256MiB", "payload memory all connections together may hold (accumulate scratch, deltas "
        "waiting behind a write); a connection that would exceed it waits (default 256MiB)", type=str)
    threads: int | None = _option(
        None, "threads a large accumulate is cut among, the loop's own included: each part is at least "
        "--thread-part bytes, and the request is answered once all parts are added, so every operation "
        "keeps its order (default: the CPUs this process may use, at most "
        f"{MAX_THREADS}; 1 = the loop adds alone; a sparse accumulate is never cut: two of its items may name "
        "one word)", type=int, metavar="N")
    thread_part: int | str = _option(
        f"{PARALLEL_ACCUMULATE >> 10}KiB", "the smallest part of an accumulate one thread adds (default "
        f"{PARALLEL_ACCUMULATE >> 10}KiB, at least {MIN_THREAD_PART >> 10}KiB): handing a part to a thread "
        "costs a few microseconds, about as much as adding a few dozen KiB", type=str)
    lock_lease: float = _option(
        DEFAULT_LEASE, "seconds a lock holder may go without renewing (default %(default)g)", type=float)
    lock_max_lease: float | None = _option(
        None, "the longest lease a client may ask for when it opens a lock; every later user of that "
        "lock gets it (default: --lock-lease, so clients may only ask for shorter)", type=float,
        metavar="SECONDS")
    lock_slots: int = _option(DEFAULT_SLOTS, "locks this server can hold (default %(default)s)", type=int)
    lock_spin: float = _option(
        DEFAULT_SPIN, "while lock waiters are parked, poll instead of sleeping for up to this many "
        f"seconds after each grant (default %(default)g; 0 = never, at most {MAX_SPIN:g})", type=float)
    metrics: str | None = _option(
        None, "serve Prometheus metrics at http://HOST:PORT/metrics (needs prometheus-client: "
        "pip install 'smb2[metrics]'; default off)", metavar="HOST:PORT")
    rdma: str = _option("auto", "serve RDMA: auto (where a device is usable; default), on, off",
                        choices=RDMA_MODES)
    rdma_device: str | None = _option(None, "RDMA device name (default: the first ACTIVE one)")
    rdma_gid_index: int | None = _option(None, "GID index (default: the port's IPv4 RoCE v2 GID)", type=int)

    shm: str = _option("auto", "hand segments to clients on this host over a Unix socket: auto (where "
                       "memfd works; default), off", choices=SHM_MODES)
    shm_socket: str | None = _option(
        None, "the Unix socket for shm clients (default: $XDG_RUNTIME_DIR/smb2/PORT-PID.sock, "
        "else under /tmp, per user)", metavar="PATH")
    membership: str | None = _option(
        None, "the coordination service holding the replicated cluster's view, "
        "etcd://HOST:PORT[,HOST:PORT]/CLUSTER-NAME (default: none; replicas=1 needs none)", metavar="URL")
    zone: str | None = _option(
        None, "the host, rack or zone this server is in: replicas of a stripe go to servers of different "
        "zones where there are enough (default: none)", metavar="NAME")
    advertise: str | None = _option(
        None, "the HOST:PORT this server is known by in the membership view and to its peers (default: "
        "the address it listens on)", metavar="HOST:PORT")
    repair_rate: int | str = _option(
        "256MiB", "bytes per second a primary sends when it copies stripes to a server that catches up "
        "(default 256MiB; 0 = unpaced)", type=str)
    replace_after: float = _option(
        30.0, "seconds a server may be out of the replicated cluster's view before the copies it held are "
        "made again on other servers (default 30; 0 = only when it comes back)", type=float, metavar="SECONDS")
    dedup_clients: int = _option(
        DEDUP_CLIENTS, f"clients whose recent replicated ops this server remembers, so that a retry is answered, "
        f"not applied twice: {DEDUP_PER_CLIENT} ops each at least, more while others leave room (about "
        f"{DEDUP_ENTRY_BYTES} bytes an op: "
        f"{DEDUP_CLIENTS * DEDUP_PER_CLIENT * DEDUP_ENTRY_BYTES >> 20} MiB at the default, as much again for "
        f"each primary that forwards to this server); a client's record goes only after {DEDUP_IDLE:g} s "
        "without a word from it, and a new client is refused while every record is younger "
        "(default %(default)s)", type=int, metavar="CLIENTS")
    # what the caps left at None were sized from (set by __post_init__)
    sizing: Sizing | None = field(default=None, init=False, repr=False, compare=False,
                                  metadata={"flag": False})

    def __post_init__(self) -> None:
        for name in ("capacity", "max_frame", "write_min_rate", "max_reply_bytes", "repair_rate", "thread_part"):
            parse_size(getattr(self, name))
        if parse_size(self.max_receive_memory) < MIN_RECEIVE_MEMORY:
            raise InvalidArgumentError(f"max receive memory must be at least {MIN_RECEIVE_MEMORY >> 20} MiB "
                                       f"(one accumulate request), not {self.max_receive_memory}")
        for name in ("write_timeout", "hello_timeout", "idle_timeout", "replace_after"):
            if not getattr(self, name) >= 0:
                raise InvalidArgumentError(f"{name.replace('_', ' ')} must be >= 0 s (0 = never), "
                                           f"not {getattr(self, name)}")
        self._size_from_machine()
        for name in ("max_connections", "max_connections_per_host", "max_inflight", "max_buffers",
                     "max_rdma_connections", "dedup_clients"):
            if not getattr(self, name) >= 1:
                raise InvalidArgumentError(f"{name.replace('_', ' ')} must be at least 1, "
                                           f"not {getattr(self, name)}")
        if self.threads is None:
            self.threads = usable_cpus()
        if not 1 <= self.threads <= MAX_THREADS:
            raise InvalidArgumentError(f"threads must be in 1..{MAX_THREADS}, not {self.threads}")
        if parse_size(self.thread_part) < MIN_THREAD_PART:
            raise InvalidArgumentError(f"thread part must be at least {MIN_THREAD_PART >> 10} KiB, "
                                       f"not {self.thread_part}")
        self._check_fd_room()
        if self.metrics is not None:
            parse_metrics_address(self.metrics)
            prometheus()        # missing: said now, not after the server started
        if self.membership is not None:
            parse_membership_url(self.membership)
        if self.zone is not None and not (0 < len(self.zone) <= 64 and self.zone.isprintable()):
            raise InvalidArgumentError(f"a zone is a printable name of 1 to 64 characters, not {self.zone!r}")
        if self.rdma not in RDMA_MODES:
            raise InvalidArgumentError(f"rdma must be auto, on or off, not {self.rdma!r}")
        if self.shm not in SHM_MODES:
            raise InvalidArgumentError(f"shm must be auto or off, not {self.shm!r}")
        if not 0 < self.lock_slots <= MAX_SLOTS:
            raise InvalidArgumentError(f"lock slots must be in 1..{MAX_SLOTS}, not {self.lock_slots}")
        if not 0 < self.lock_lease <= MAX_LEASE:
            raise InvalidArgumentError(f"lock lease must be in (0, {MAX_LEASE:g}] s, not {self.lock_lease:g}")
        if self.lock_max_lease is not None and not self.lock_lease <= self.lock_max_lease <= MAX_LEASE:
            raise InvalidArgumentError(f"lock max lease must be in [lock lease ({self.lock_lease:g}), "
                                       f"{MAX_LEASE:g}] s, not {self.lock_max_lease:g}")
        if not 0 <= self.lock_spin <= MAX_SPIN:
            raise InvalidArgumentError(f"lock spin must be in [0, {MAX_SPIN:g}] s, not {self.lock_spin:g}")

    def _size_from_machine(self) -> None:
        """Give every cap left at None the value this machine allows
        (sizing.py); ``sizing`` keeps what they were derived from."""
        for name in ("max_inflight", "max_buffers", "dedup_clients"):
            if not getattr(self, name) >= 1:     # sizing divides by them: said first
                raise InvalidArgumentError(f"{name.replace('_', ' ')} must be at least 1, "
                                           f"not {getattr(self, name)}")
        self.sizing = size(capacity=self.capacity, max_receive_memory=self.max_receive_memory,
                           max_reply_bytes=self.max_reply_bytes, max_inflight=self.max_inflight,
                           memfd_segments=hasattr(os, "memfd_create") and self.shm != "off")
        for name in AUTO_CAPS:
            if getattr(self, name) is None:
                setattr(self, name, getattr(self.sizing, name))
        assert self.rdma_staging_memory is not None
        if parse_size(self.rdma_staging_memory) < RDMA_STAGING_BYTES:
            raise InvalidArgumentError(f"rdma staging memory must hold one staging area of {RDMA_STAGING_BYTES >> 20} "
                                       f"MiB at least, not {self.rdma_staging_memory}")

    def _check_fd_room(self) -> None:
        """``max_buffers`` against the process's file limit: each buffer's
        segment holds FDS_PER_SEGMENT descriptors (where segments are
        memfds), each connection one.  The default is lowered to what fits
        (a WARNING); a cap asked for that does not fit is refused, before
        the server starts rather than at the buffer that finds no fd."""
        if not hasattr(os, "memfd_create") or self.shm == "off":
            return      # segments are then anonymous memory, without a descriptor
        assert self.max_connections is not None        # sized by now
        room = buffers_within_fd_limit(self.max_connections)
        if self.max_buffers <= room:
            return
        need = (self.max_buffers + 1) * FDS_PER_SEGMENT + self.max_connections + FDS_SPARE
        if self.max_buffers == DEFAULT_MAX_BUFFERS and room >= 1:
            log.warning("max buffers lowered from %d to %d: this process may open %d files (ulimit -n), and %d "
                        "buffers would need %d (%d per buffer, one per connection of --max-connections %d); raise "
                        "the limit to keep %d", self.max_buffers, room, fd_limit(), self.max_buffers, need,
                        FDS_PER_SEGMENT, self.max_connections, self.max_buffers)
            self.max_buffers = room
            return
        raise InvalidArgumentError(
            f"--max-buffers {self.max_buffers} needs {need} file descriptors ({FDS_PER_SEGMENT} per buffer: its memfd "
            f"and its mapping; one per connection of --max-connections {self.max_connections}; {FDS_SPARE} spare), and "
            f"this process may open {fd_limit()} (ulimit -n): at most {room} buffers fit",
            hint=f"lower --max-buffers to {room}, or raise the file limit (ulimit -n, or LimitNOFILE= in a systemd "
                 "unit) and start again")
