"""The host agent (``smb2-agent``): one process per worker host, between
the host's workers and the memory servers.

It runs an ordinary memory server in its own event loop, which the host's
workers reach over shm, and is the host's one client of the memory
servers.  A worker mirrors a region of a remote buffer through it
(:class:`smb2.mirror.AgentMirror`, the worker side, which imports only the
client side) and pushes into the mirror on its own host; the agent forwards
the host's combined pushes as one remote accumulate per cycle and pulls the
region once per cycle for all of the host's workers.

service.py  Agent: its server, its client of the memory servers, finding the mirrors
forward.py  Mirror: one mirror taken up, its forward cycle (and why it is exact), its failure
cli.py      the ``smb2-agent`` command (also ``python -m smb2.agent``)
"""

from .cli import main
from .forward import DEFAULT_GATHER, DEFAULT_PERIOD, Mirror
from .service import Agent

__all__ = ["DEFAULT_GATHER", "DEFAULT_PERIOD", "Agent", "Mirror", "main"]
