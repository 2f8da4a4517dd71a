#!/usr/bin/env python3
"""Coverage-guided fuzzing of the server's frame handling with atheris
(``pip install atheris``), in process and without sockets: the input is a byte
stream plus the points where recv() splits it, fed to a server connection by
the harness in smb2.testing.fuzzing, which checks after every input that the
server sent only whole well-formed replies and that a dropped connection left
nothing behind.  A crash or a broken invariant stops the run with the input
saved by libFuzzer.

    python tools/fuzz_atheris.py -atheris_runs=200000
    python tools/fuzz_atheris.py -max_total_time=600 corpus/
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import smb2.protocol  # noqa: F401
    import smb2.server  # noqa: F401
    from smb2.testing import fuzzing

_harness: fuzzing.Harness | None = None
_frames = 0


def split(data: bytes) -> tuple[bytes, list[int]]:
    """Input layout: one byte (bit 7: prepend a hello, bits 0-2: k), k
    little-endian u16 recv cut points, then the byte stream."""
    if not data:
        return b"", []
    k = data[0] & 7
    cuts = [int.from_bytes(data[1 + 2 * i:3 + 2 * i], "little") for i in range(k)]
    body = data[1 + 2 * k:]
    return (fuzzing.hello() if data[0] & 0x80 else b"") + body, cuts


def test_one_input(data: bytes) -> None:
    global _harness, _frames
    if _harness is None:
        _harness = fuzzing.Harness()
    stream, cuts = split(data)
    _harness.feed(stream, cuts)
    _frames += 1


def seed_corpus(directory: Path, n: int = 300) -> None:
    """Valid and lightly mutated streams: libFuzzer starts deep in the protocol."""
    import random

    rng = random.Random(0)
    h = fuzzing.Harness()
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        data, _ = fuzzing.stream(rng, h.segment, 1 << 16, max_frames=6)
        cuts = [rng.randrange(min(len(data), 65535) + 1) for _ in range(rng.randrange(4))]
        head = bytes([len(cuts)]) + b"".join(c.to_bytes(2, "little") for c in cuts)
        (directory / f"seed-{i}").write_bytes(head + data)


def main() -> None:
    # the server's connection asks which loop it runs on; give it one
    loop = asyncio.new_event_loop()
    asyncio.events._set_running_loop(loop)
    argv = list(sys.argv)
    if not [a for a in argv[1:] if not a.startswith("-")]:
        # no corpus given: start from a seed corpus of valid streams
        corpus = Path(tempfile.mkdtemp(prefix="smb2-atheris-"))
        seed_corpus(corpus)
        argv.append(str(corpus))
    atheris.Setup(argv, test_one_input)
    try:
        atheris.Fuzz()
    finally:
        print(f"fuzz_atheris: {_frames} inputs", file=sys.stderr)


if __name__ == "__main__":
    main()
