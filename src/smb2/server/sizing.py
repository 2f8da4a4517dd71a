"""The defaults of a memory server's caps, sized from the machine it starts on.

A cap left unset (``--max-connections``, ``--max-connections-per-host``,
``--max-rdma-connections``) is derived here from what the process may use:
its file limit (``ulimit -n``, after the server raised the soft limit to the
hard one) and the machine's memory (the smaller of the physical memory and a
cgroup's ``memory.max``).  So the defaults grow with the machine instead of
being one number that a mid-size job outgrows, and ``smb2-server --help``,
the start-up log, ``stat`` and ``smb2 doctor`` all state the values taken and
what they came from.  docs/operations.md gives the rules in words.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..protocol import parse_size
from .memfd import FDS_PER_SEGMENT, FDS_SPARE, buffers_within_fd_limit, fd_limit
from .rdma import STAGING_BYTES

log = logging.getLogger("smb2.server")

KiB = 1 << 10
MiB = 1 << 20

# a connection's worst case besides its queued replies and parked requests
# (docs/operations.md, "Memory budget"): its inbox after authentication, one
# batch of small replies, its own objects
CONNECTION_FIXED_BYTES = 256 * KiB + 64 * KiB + 4 * KiB
# per request waiting for its reply
INFLIGHT_BYTES = KiB
# the pinned staging area one RDMA connection registers
RDMA_STAGING_BYTES = STAGING_BYTES
# the share of the machine's memory the RDMA peers' pinned staging areas may
# take, and of the memory left beside the capacity (a container's limit)
RDMA_MEMORY_SHARE = 16
STAGING_SPARE_SHARE = 4
# --max-buffers' default, lowered to what the file limit holds (options.py)
DEFAULT_MAX_BUFFERS = 4096
# bounds of the derived defaults: a machine too small for the floor still
# gets it (the memory budget in operations.md says what that costs), and the
# ceilings keep one process's bookkeeping sane
MIN_CONNECTIONS = 64
MAX_CONNECTIONS = 65536
# staging areas: at least the 64 every server had before they were pooled
MIN_STAGING_AREAS = 64
MAX_STAGING_AREAS = 4096
# one source address may take this share of the connections (at least
# MIN_PER_HOST): a host of many workers fits, one host cannot take all
PER_HOST_SHARE = 4
MIN_PER_HOST = 128


def machine_memory() -> int:
    """Bytes of memory this process's machine (or its cgroup) has."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 1 << 34
    # a container's limit: cgroup v2, else v1 (whose "no limit" is a huge number)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
        break
    return total


def connection_bytes(max_reply_bytes: int, max_inflight: int) -> int:
    """The most memory one busy connection holds (operations.md's per-connection term)."""
    return CONNECTION_FIXED_BYTES + max_reply_bytes + max_inflight * INFLIGHT_BYTES


@dataclass(frozen=True)
class Sizing:
    """What the caps' defaults were derived from, and the values."""

    fd_limit: int
    memory: int
    connection_bytes: int
    max_connections: int
    max_connections_per_host: int
    max_rdma_connections: int
    # a size, as the option takes it ("256MiB")
    rdma_staging_memory: str
    # which of the file limit and memory bounds the connections
    connections_bound_by: str
    # buffers whose memfds fit in the file limit beside the connections
    # (--max-buffers' default is lowered to it)
    buffers_fit: int

    def describe(self) -> dict[str, int | str]:
        """For stat and smb2 doctor."""
        return {"fd_limit": self.fd_limit, "memory": self.memory, "connection_bytes": self.connection_bytes,
                "connections_bound_by": self.connections_bound_by}


def size(*, capacity: int | str, max_receive_memory: int | str, max_reply_bytes: int | str,
         max_inflight: int, memfd_segments: bool, fds: int | None = None, memory: int | None = None) -> Sizing:
    """The caps' defaults for a server with these options on this machine
    (or with ``fds`` files and ``memory`` bytes).

    * connections: the fewer of the file limit's share (half of it after the
      spare descriptors where buffers hold memfds, the rest for the buffers;
      all of it otherwise) and the memory left beside ``capacity`` and
      ``max_receive_memory``, halved, over a busy connection's worst case;
    * per source address: a quarter of that, at least 128;
    * RDMA connections: as many as connections (a queue pair is a few KiB);
    * their staging areas: a sixteenth of the memory (at most a quarter of
      what it leaves beside ``capacity``), in 4 MiB areas, at least 64 of
      them (a peer beyond them sends its accumulates in-band).
    """
    if fds is None:
        fds = fd_limit()
    if memory is None:
        memory = machine_memory()
    per_conn = connection_bytes(parse_size(max_reply_bytes), max_inflight)
    fd_share = (fds - FDS_SPARE) // FDS_PER_SEGMENT if memfd_segments else fds - FDS_SPARE
    spare_memory = max(0, memory - parse_size(capacity) - parse_size(max_receive_memory))
    memory_share = spare_memory // 2 // per_conn
    bound_by = "file limit" if fd_share <= memory_share else "memory"
    conns = max(MIN_CONNECTIONS, min(fd_share, memory_share, MAX_CONNECTIONS))
    staging = min(memory // RDMA_MEMORY_SHARE, spare_memory // STAGING_SPARE_SHARE)
    areas = max(MIN_STAGING_AREAS, min(staging // RDMA_STAGING_BYTES, MAX_STAGING_AREAS))
    return Sizing(fd_limit=fds, memory=memory, connection_bytes=per_conn, max_connections=conns,
                  max_connections_per_host=max(MIN_PER_HOST, conns // PER_HOST_SHARE),
                  max_rdma_connections=conns, rdma_staging_memory=f"{areas * RDMA_STAGING_BYTES >> 20}MiB",
                  connections_bound_by=bound_by,
                  buffers_fit=min(DEFAULT_MAX_BUFFERS, buffers_within_fd_limit(conns, fds)) if memfd_segments
                  else DEFAULT_MAX_BUFFERS)
