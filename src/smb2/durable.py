"""Files that survive a crash, shared by the server's data directory and the
client's checkpoints: both stream large memory in chunks and publish a file
only once it is complete (a temporary name, fsync, rename, fsync of the
directory)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

#: bytes streamed at a time: memory for a save or restore stays at a few chunks
CHUNK: Final = 8 << 20


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def chunks(n: int, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of each piece of ``n`` bytes cut into ``chunk``-sized pieces."""
    for off in range(0, n, chunk):
        yield off, min(chunk, n - off)
