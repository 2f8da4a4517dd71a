"""What a process learns of the host it runs on (shared by both sides): the
boot id that tells two processes they are on one host and the seal that
marks memory only its server may write (the server's shm hand-out and the
shm transport), and the CPUs this process may use (how many threads a
server's accumulates and a client's large copies are cut among)."""

from __future__ import annotations

import fcntl
import os

#: a memfd sealed so (Linux 5.1) has no writable mapping but those made
#: before the seal: the server's.  A replicated buffer's segments are (its
#: copies change only through its primary); clients map them read-only.
#: Python's fcntl names it from 3.12.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This kernel's boot id (one per boot of one machine), or None where
    the system does not say (not Linux)."""
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip() or None
    except OSError:
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: what taskset, a
    cgroup's cpuset or Slurm's binding leave it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def writable_by_clients(fd: int) -> bool:
    """Whether a handed-out memfd may be mapped writable (not sealed
    F_SEAL_FUTURE_WRITE)."""
    return not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
