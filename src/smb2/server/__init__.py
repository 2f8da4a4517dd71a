"""The memory server: owns RAM as segments and serves them to clients.

memory.py  the server and its connections (frames, control commands)
segment.py a segment's memory, and ``Refused``: the error a request gets
locks.py   the lock service: the lock segment, parked waiters, leases, fences
rdma.py    the RDMA side: segments' memory regions, per-client queue pairs
datadir.py the data directory: segments saved on stop, restored on start
cli.py     the ``smb2-server`` command (also ``python -m smb2.server``)
"""

from .cli import main
from .memory import MemoryServer, start_server

__all__ = ["MemoryServer", "main", "start_server"]
