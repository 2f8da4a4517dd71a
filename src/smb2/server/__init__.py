"""The memory server: owns RAM as segments and serves them to clients.

memory.py  the server and its connections (frames, control commands)
options.py ServerOptions: every option, read by MemoryServer, start_server, smb2-server
segment.py a segment's memory, and ``Refused``: the error a request gets
locks.py   the lock service: the lock segment, parked waiters, leases, fences
rdma.py    the RDMA side: segments' memory regions, per-client queue pairs
datadir.py the data directory: segments saved on stop, restored on start
cli.py     the ``smb2-server`` command (also ``python -m smb2.server``)
"""

from .cli import main
from .memory import MemoryServer, start_server
from .options import ServerOptions

__all__ = ["MemoryServer", "ServerOptions", "main", "start_server"]
