"""A fault-injecting TCP proxy for tests (asyncpg's ``_testbase/fuzzer.py``
idea): it runs its own event loop in a thread, so it keeps forwarding (or
cutting) whatever the test's loop is blocked on, and it can cut a connection
at an exact byte count, i.e. in the middle of a request or of a reply.

    proxy = FaultProxy(server_address).start()
    client = await smb2.connect([proxy.address])
    proxy.cut_after(up=1 << 20)        # abort once 1 MiB more went client -> server
    proxy.hold(); ...; proxy.release() # the server sees what was sent meanwhile late
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass


@dataclass
class _Arm:
    up: int | None = None        # cut after this many more client->server bytes
    down: int | None = None      # ... or server->client bytes


class _Pair:
    def __init__(self, proxy: FaultProxy, cw: asyncio.StreamWriter, sw: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.cw = cw
        self.sw = sw
        self.cut = False

    def abort(self) -> None:
        # abort, not close: a RST in both directions, no orderly shutdown,
        # like a cable pulled or a middlebox dropping the flow
        if not self.cut:
            self.cut = True
            self.proxy.cuts += 1
        for w in (self.cw, self.sw):
            w.transport.abort()

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool) -> None:
        proxy = self.proxy
        try:
            while not self.cut:
                data = await reader.read(1 << 16)
                if not data:
                    break
                arm = proxy._arm
                left = arm.up if up else arm.down
                if left is not None and len(data) >= left:
                    # forward exactly up to the cut, then drop the flow
                    writer.write(data[:left])
                    if up:
                        arm.up = None
                    else:
                        arm.down = None
                    proxy._count(up, left)
                    self.abort()
                    return
                if left is not None:
                    if up:
                        arm.up = left - len(data)
                    else:
                        arm.down = left - len(data)
                if up and not proxy._flowing.is_set():
                    proxy.held += len(data)
                    await proxy._flowing.wait()
                    proxy.held -= len(data)
                proxy._count(up, len(data))
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not self.cut:
                try:
                    writer.write_eof()
                except (OSError, RuntimeError):
                    writer.transport.abort()


class FaultProxy:
    def __init__(self, target: tuple[str, int] | str, host: str = "127.0.0.1") -> None:
        if isinstance(target, str):
            h, p = target.rsplit(":", 1)
            target = (h, int(p))
        self.target = target
        self.host = host
        self.address = ""
        self.connections = 0
        self.cuts = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._arm = _Arm()
        #: client->server bytes waiting in the proxy while it holds them (:meth:`hold`)
        self.held = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._pairs: set[_Pair] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    # -- control from the test's thread -----------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        server: asyncio.Server = self._call(asyncio.start_server(self._accept, self.host, 0))
        self._server = server
        port = server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}"
        return self

    def cut_after(self, *, up: int | None = None, down: int | None = None) -> None:
        """Cut every connection once ``up`` more bytes went client->server
        (or ``down`` more server->client), forwarding exactly that many."""
        def arm() -> None:
            self._arm = _Arm(up, down)
        self._loop.call_soon_threadsafe(arm)

    def hold(self) -> None:
        """Hold what clients send (it waits in the proxy, in order) until
        :meth:`release`: the server sees those requests late, when the test
        says; :attr:`held` counts the bytes waiting."""
        self._call(self._flow(False))

    def release(self) -> None:
        """Forward what was held, and whatever comes next."""
        self._call(self._flow(True))

    def cut_all(self) -> None:
        """Abort every connection now."""
        def cut() -> None:
            for p in list(self._pairs):
                p.abort()
        self._loop.call_soon_threadsafe(cut)

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for p in list(self._pairs):
                p.abort()
            await self._server.wait_closed()
        if self._thread.is_alive():
            self._call(close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # -- the proxy's loop ----------------------------------------------------
    async def _flow(self, on: bool) -> None:
        if on:
            self._flowing.set()
        else:
            self._flowing.clear()

    def _count(self, up: bool, n: int) -> None:
        if up:
            self.bytes_up += n
        else:
            self.bytes_down += n

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            sreader, swriter = await asyncio.open_connection(*self.target)
        except OSError:
            cwriter.transport.abort()
            return
        pair = _Pair(self, cwriter, swriter)
        self._pairs.add(pair)
        try:
            await asyncio.gather(pair.pump(creader, swriter, True), pair.pump(sreader, cwriter, False))
        finally:
            self._pairs.discard(pair)
            for w in (cwriter, swriter):
                if pair.cut:
                    w.transport.abort()
                else:
                    w.close()
