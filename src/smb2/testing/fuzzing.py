"""Frame fuzzing helpers shared by tests/test_fuzz.py and tools/fuzz_atheris.py.

Everything takes a ``random.Random``: hypothesis hands the tests one it
controls (``st.randoms()``, so failures shrink and replay), the atheris
driver and the concurrent test seed their own.  Streams start from valid
frames (a hello, then ops aimed at a real segment) and are then mutated:
bits flipped, header fields replaced, frames truncated, duplicated,
concatenated, garbage spliced in.  Valid-looking frames get far deeper into
the server than random bytes, which die at the magic check.
"""

from __future__ import annotations

import random
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field

import msgpack

from smb2 import _core
from smb2.errors import ErrorCode
from smb2.protocol import FLAG_REPLY, MAGIC, VERSION, Op

from .wire import control, frame, hello

HEADER = 32
# header layout (docs/protocol.md): field -> (offset, struct format)
FIELDS = {
    "magic": (0, "<H"), "version": (2, "<B"), "op": (3, "<B"), "flags": (4, "<H"),
    "status": (6, "<H"), "rid": (8, "<I"), "segment": (12, "<I"), "offset": (16, "<Q"),
    "length": (24, "<Q"),
}
COMMANDS = ["hello", "auth", "create", "lookup", "destroy", "list", "stat", "lock_open", "lock_abandon",
            "shm_grant", "bogus"]


# -- values for control messages -------------------------------------------

def _scalar(rng: random.Random) -> object:
    k = rng.randrange(10)
    if k == 0:
        return None
    if k == 1:
        return rng.random() < 0.5
    if k == 2:
        return rng.choice([0, 1, -1, 8, 4096, 2**31, 2**63 - 1, -(2**63), 2**64 - 1])
    if k == 3:
        return rng.randrange(-(2**63), 2**64)
    if k == 4:
        return rng.random() * 10 ** rng.randrange(-5, 30)
    if k == 5:
        return "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(20)))
    if k == 6:
        return rng.randbytes(rng.randrange(40))
    if k == 7:
        return "x" * rng.choice([255, 256, 70000])           # long names
    if k == 8:
        return rng.choice(COMMANDS)
    return rng.randrange(0, 1 << 24)


def msg_value(rng: random.Random, depth: int = 0) -> object:
    if depth > 3 or rng.random() < 0.6:
        return _scalar(rng)
    if rng.random() < 0.5:
        return [msg_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(_scalar(rng))[:20]: msg_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def control_payload(rng: random.Random, seg_name: str = "scratch") -> bytes:
    """A malformed (sometimes valid) control message body."""
    k = rng.randrange(9)
    if k == 0:
        return rng.randbytes(rng.randrange(64))                        # not msgpack
    if k == 1:
        return msgpack.packb(msg_value(rng), use_bin_type=True)         # any value
    if k == 2:                                                          # deep nesting
        depth = rng.choice([100, 1000, 5000, 20000])
        return (b"\x91" if rng.random() < 0.5 else b"\x81\xa1k") * depth + b"\xc0"
    if k == 3:                                                          # huge string
        return msgpack.packb({"cmd": "create", "name": "n" * rng.choice([300, 1 << 16, 1 << 19]),
                              "nbytes": 8, "stripe": 8, "nservers": 1, "index": 0})
    if k == 4:                                                          # a lying length prefix
        return b"\xdb" + struct.pack(">I", rng.randrange(1 << 32)) + b"abc"
    # a real command whose fields are missing, extra or of the wrong type
    msg: dict[str, object] = {"cmd": rng.choice(COMMANDS)}
    good = {"name": seg_name, "nbytes": 4096, "stripe": 1024, "nservers": 1, "index": 0,
            "version": VERSION, "nonce": b"n" * 32, "proof": b"p" * 32, "segments": [0]}
    for key, value in good.items():
        r = rng.random()
        if r < 0.5:
            msg[key] = value
        elif r < 0.8:
            msg[key] = _scalar(rng)
    if rng.random() < 0.2:
        msg[str(_scalar(rng))[:10]] = msg_value(rng)
    return msgpack.packb(msg, use_bin_type=True)


# -- frames ------------------------------------------------------------------

def valid_frame(rng: random.Random, segment: int, seg_size: int, rid: int) -> bytes:
    """A well-formed request aimed at a real segment (mostly in bounds)."""
    op = rng.choice([Op.READ, Op.WRITE, Op.ACCUMULATE, Op.FETCH_ADD, Op.COMPARE_SWAP,
                     Op.ACCUMULATE_SPARSE, Op.CONTROL, Op.CONTROL])
    off = rng.randrange(0, seg_size, 8)
    n = rng.randrange(0, min(4096, seg_size - off) + 1) & ~7
    if op == Op.READ:
        return frame(op, rid=rid, segment=segment, offset=off, length=n)
    if op == Op.WRITE:
        return frame(op, rng.randbytes(n), rid=rid, segment=segment, offset=off)
    if op == Op.ACCUMULATE:
        code = rng.randrange(1, 7)      # 5, 6: a half-width delta covering twice n
        return frame(op, rng.randbytes(n), rid=rid, segment=segment, offset=off,
                     flags=code << 4)
    if op == Op.ACCUMULATE_SPARSE:
        # a count, indices mostly within the segment (u32), float32 or bf16 values
        k = rng.randrange(0, 64)
        code = rng.choice([1, 5])
        words = max(1, (seg_size - off) // 4)
        idx = b"".join(rng.randrange(words + 2).to_bytes(4, "little") for _ in range(k))
        return frame(op, k.to_bytes(8, "little") + idx + rng.randbytes(k * (4 if code == 1 else 2)), rid=rid,
                     segment=segment, offset=off, flags=code << 4)
    if op == Op.FETCH_ADD:
        return frame(op, rng.randbytes(8), rid=rid, segment=segment, offset=off)
    if op == Op.COMPARE_SWAP:
        return frame(op, rng.randbytes(16), rid=rid, segment=segment, offset=off)
    if rng.random() < 0.5:
        cmd = rng.choice(["list", "stat", "lookup"])
        return control({"cmd": cmd, "name": "fuzz"}, rid)
    return frame(Op.CONTROL, control_payload(rng), rid=rid)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One mutation of one frame."""
    b = bytearray(data)
    k = rng.randrange(8)
    if k == 0 and b:                                   # flip a few bits
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif k in (1, 2, 3) and len(b) >= HEADER:          # replace a header field
        name = rng.choice(list(FIELDS))
        pos, fmt = FIELDS[name]
        bits = struct.calcsize(fmt) * 8
        value = rng.choice([0, 1, (1 << bits) - 1, 1 << (bits - 1), rng.randrange(1 << bits)])
        if name == "op":
            value = rng.choice([0, 7, 99, 255, *list(Op)])
        elif name == "length" and rng.random() < 0.7:
            value = max(0, len(b) - HEADER + rng.randrange(-16, 17))
        elif name == "version" and rng.random() < 0.5:
            value = VERSION
        struct.pack_into(fmt, b, pos, value)
    elif k == 4 and b:                                 # truncate
        del b[rng.randrange(len(b)):]
    elif k == 5:                                       # extend with garbage
        b += rng.randbytes(rng.randrange(1, 64))
    elif k == 6:                                       # duplicate
        b += bytes(b)
    else:                                              # splice garbage inside
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randrange(1, 16))
    return bytes(b)


def stream(rng: random.Random, segment: int, seg_size: int, *, max_frames: int = 12,
           prefix: bytes | None = None) -> tuple[bytes, int]:
    """Bytes for one connection and how many frames went into them."""
    parts = []
    greet = rng.random() < 0.9
    if greet:
        parts.append(prefix if prefix is not None else hello())
    nframes = rng.randrange(1, max_frames + 1)
    for i in range(nframes):
        f = valid_frame(rng, segment, seg_size, rid=i + 2)
        # most frames stay valid: the first stream-breaking one ends the
        # connection, and the frames behind it would never be parsed
        if rng.random() < 0.25:
            f = mutate(f, rng)
        parts.append(f)
    if rng.random() < 0.1:
        parts.append(rng.randbytes(rng.randrange(1, 256)))
    return b"".join(parts), nframes + greet


# -- talking to the server ---------------------------------------------------

@dataclass
class Replies:
    frames: list[tuple[int, ...]] = field(default_factory=list)
    trailing: int = 0          # bytes after the last whole frame (must be 0)


def parse_replies(data: bytes) -> Replies:
    out = Replies()
    pos = 0
    while len(data) - pos >= HEADER:
        hdr = _core.decode_header(data, pos)
        if hdr[0] != MAGIC or not hdr[3] & FLAG_REPLY or len(data) - pos - HEADER < hdr[8]:
            break
        out.frames.append(hdr)
        pos += HEADER + hdr[8]
    out.trailing = len(data) - pos
    return out


def exchange(address: tuple[str, int], data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data``, half-close, and collect everything the server says until it
    closes.  Sends and receives interleave: a server that stops reading a client
    who does not read its replies (flow control) must not deadlock us."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    out = bytearray()
    view = memoryview(data)
    sent = 0
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"server neither answered nor closed within {timeout} s "
                                   f"({sent}/{len(data)} bytes sent)")
            for _key, ev in sel.select(left):
                if ev & selectors.EVENT_WRITE:
                    try:
                        sent += sock.send(view[sent:sent + 65536])
                    except (BrokenPipeError, ConnectionResetError):
                        sent = len(data)
                    if sent >= len(data):
                        try:
                            sock.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                        sel.modify(sock, selectors.EVENT_READ)
                if ev & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(1 << 16)
                    except ConnectionResetError:
                        chunk = b""
                    if not chunk:
                        return bytes(out)
                    out += chunk
    finally:
        sel.close()
        sock.close()


def check_replies(data: bytes) -> Replies:
    """Every byte the server sent is a whole, well-formed reply frame."""
    r = parse_replies(data)
    assert r.trailing == 0, f"{r.trailing} bytes of garbage/partial frame in the server's replies"
    codes = {int(c) for c in ErrorCode}
    for hdr in r.frames:
        assert hdr[1] == VERSION and hdr[4] in codes, hdr
    return r


# -- in process, no sockets: the server's frame handling fed byte by byte --------

class FakeTransport:
    """Just enough of an asyncio transport for ``smb2.server.connection.Connection``."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.paused = False

    def write(self, data: bytes | memoryview) -> None:
        if not self.closed:
            self.out += data

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        for p in parts:
            self.write(p)

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass        # everything written lands in ``out`` at once: never paused

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return len(self.out)


class Harness:
    """A MemoryServer and connections driven synchronously: ``feed(data, cuts)``
    delivers ``data`` in pieces split at ``cuts`` (so every recv boundary can be
    tried, which a socket does not let a test choose), then drops the
    connection and checks the invariants.  Needs a running event loop (the
    connection asks which loop it runs on); tools/fuzz_atheris.py sets one."""

    def __init__(self) -> None:
        from smb2.server import MemoryServer

        self.server = MemoryServer(capacity="8MiB", max_buffers=16)
        info = self.server.create("fuzz", 1 << 16, 1024, 1, 0)
        self.segment = int(info["segment"])

    def feed(self, data: bytes, cuts: list[int]) -> Replies:
        from smb2.server.connection import Connection

        conn = Connection(self.server)
        t = FakeTransport()
        conn.connection_made(t)  # type: ignore[arg-type]
        pos = 0
        for cut in sorted({min(max(c, 0), len(data)) for c in cuts} | {len(data)}):
            while pos < cut and not t.closed:
                buf = conn.get_buffer(cut - pos)
                n = min(len(buf), cut - pos)
                if n == 0:
                    raise AssertionError("get_buffer returned an empty buffer")
                buf[:n] = data[pos:pos + n]
                conn.buffer_updated(n)
                pos += n
        conn.connection_lost(None)
        assert conn not in self.server.connections
        for seg in self.server.segments.values():
            assert not seg.inflight, "a dropped connection left a write in flight"
        r = check_replies(bytes(t.out))
        # keep the server small: the fuzzer may create buffers
        for name in [n for n in self.server.by_name if n != "fuzz"]:
            self.server.destroy(name)
        if "fuzz" not in self.server.by_name:
            self.segment = int(self.server.create("fuzz", 1 << 16, 1024, 1, 0)["segment"])
        return r
