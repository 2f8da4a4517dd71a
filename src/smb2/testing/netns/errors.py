"""What the netns harness raises: it failed (:class:`NetnsError`), it cannot run here
(:class:`NotSupported`), a server did not start, or a signal ended the run (:class:`Terminated`)."""

from __future__ import annotations

import signal


class NetnsError(RuntimeError):
    """Building, using or tearing down the namespace cluster failed."""


class NotSupported(NetnsError):
    """This machine/user cannot build network namespaces (not root, no ``ip netns``, ...)."""


class ServerStartError(NetnsError):
    """A server did not print its ``smb2-server listening on HOST:PORT`` line in time."""


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM/SIGHUP while a cluster is up (like KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")
        self.signum = signum
