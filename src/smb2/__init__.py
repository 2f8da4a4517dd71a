"""smb2: SoftMemoryBox II, a shared memory buffer striped over many memory
servers, for distributed deep-learning training.

    import smb2
    async with await smb2.connect(["127.0.0.1:7420"]) as client:
        buf = await client.create("params", 1 << 20)
        await buf.write(0, b"hello")

Importing smb2 loads the client side only.  The server side (``smb2.Server``,
``smb2.start_server``) and the test cluster (``smb2.LocalCluster``, which
lives in the lab, :mod:`smb2.testing`) are loaded on first use, so a training
worker never imports server code and the library never imports the lab.
"""

from typing import TYPE_CHECKING, Any

from .client import Buffer, Client, connect
from .errors import (
    AccessDenied,
    AgentLost,
    AgentTimeout,
    BadRequest,
    BufferConflict,
    BufferDamaged,
    ErrorCode,
    FrameTooLarge,
    InterfaceError,
    InvalidArgumentError,
    LockLost,
    LockTimeout,
    MembershipError,
    NoSuchBuffer,
    NotifyTimeout,
    OperationTimeout,
    OutOfBounds,
    OutOfMemory,
    PersistenceError,
    ProtocolError,
    ServerError,
    Smb2Error,
    StaleFence,
    StaleHandle,
    TransportError,
    Unsupported,
    VersionMismatch,
)
from .lock import Fence, Lock, ReplicatedLock
from .version import __version__ as __version__

if TYPE_CHECKING:
    from .server import MemoryServer as Server
    from .server import start_server
    from .testing import LocalCluster

#: names loaded on first use: (module, attribute)
_LAZY = {"LocalCluster": ("testing.cluster", "LocalCluster"), "Server": ("server", "MemoryServer"),
         "start_server": ("server", "start_server")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AccessDenied", "AgentLost", "AgentTimeout", "BadRequest", "Buffer", "BufferConflict", "BufferDamaged", "Client",
    "ErrorCode",
    "Fence", "FrameTooLarge", "InterfaceError", "Lock", "InvalidArgumentError", "LocalCluster", "LockLost",
    "ReplicatedLock",
    "LockTimeout",
    "MembershipError", "NoSuchBuffer", "NotifyTimeout", "OperationTimeout", "OutOfBounds", "OutOfMemory",
    "PersistenceError", "ProtocolError", "Server", "ServerError",
    "Smb2Error", "StaleFence", "StaleHandle", "TransportError", "Unsupported", "VersionMismatch", "connect",
    "start_server",
]
