"""What tells two processes that they run on the same host (shared by the
server's shm hand-out and the shm transport)."""

from __future__ import annotations

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This kernel's boot id (one per boot of one machine), or None where
    the system does not say (not Linux)."""
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip() or None
    except OSError:
        return None
