"""What two processes on the same host agree on (shared by the server's shm
hand-out and the shm transport): the boot id that tells them they are on one
host, and the seal that marks memory only its server may write."""

from __future__ import annotations

import fcntl

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


def writable_by_clients(fd: int) -> bool:
    """Whether a handed-out memfd may be mapped writable (not sealed
    F_SEAL_FUTURE_WRITE)."""
    return not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
