"""smb2: SoftMemoryBox II, a shared memory buffer striped over many memory
servers, for distributed deep-learning training.

    import smb2
    async with await smb2.connect(["127.0.0.1:7420"]) as client:
        buf = await client.create("params", 1 << 20)
        await buf.write(0, b"hello")
"""

from .client import Buffer, Client, connect
from .cluster import LocalCluster
from .errors import (
    AccessDenied,
    BadRequest,
    BufferConflict,
    ErrorCode,
    FrameTooLarge,
    InterfaceError,
    InvalidArgumentError,
    LockTimeout,
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
from .lock import Fence, Lock
from .server import MemoryServer as Server
from .server import start_server
from .version import __version__ as __version__

__all__ = [
    "AccessDenied", "BadRequest", "Buffer", "BufferConflict", "Client", "ErrorCode",
    "Fence", "FrameTooLarge", "InterfaceError", "Lock", "InvalidArgumentError", "LocalCluster", "LockTimeout",
    "NoSuchBuffer", "NotifyTimeout", "OperationTimeout", "OutOfBounds", "OutOfMemory", "PersistenceError",
    "ProtocolError", "Server", "ServerError",
    "Smb2Error", "StaleFence", "StaleHandle", "TransportError", "Unsupported", "VersionMismatch", "connect",
    "start_server",
]
