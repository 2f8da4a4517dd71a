"""A Jepsen history: every operation a client invoked, with its outcome and times, the
nemesis's faults, and the state read at the end (:class:`History`, JSON lines on disk)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

OK, FAIL, UNKNOWN = "ok", "fail", "unknown"
NEMESES = ("kill", "pause", "restart", "partition")
BUFFER = "jepsen"
LOCK = "jepsen-lock"
STRIPE = 4096


@dataclass
class Op:
    """One invocation and its outcome."""

    process: int
    kind: str                       # accumulate | fetch_add | read | lock_rmw | final
    key: int = 0                    # the counter (accumulate, read)
    value: int = 0                  # the increment (accumulate, fetch_add)
    invoke: float = 0.0             # time.monotonic() when it was invoked
    complete: float = 0.0           # ... when its outcome was known
    outcome: str = UNKNOWN
    result: Any = None              # read: the value; fetch_add: the old value; lock_rmw: see below
    error: str = ""
    # lock_rmw: the token, when the lock was held (acquired .. about to release), the value read,
    # and the outcome of the fenced write (the op's outcome; unknown where the write was
    # acknowledged after the holder learned it had lost the lock: it landed, unprotected)
    token: int | None = None
    held: tuple[float, float] | None = None


@dataclass
class Layout:
    """Where each kind of word lives in the buffer (one stripe each, so every server holds some)."""

    counters: int

    @property
    def nbytes(self) -> int:
        return (self.counters + 2) * STRIPE

    def counter(self, k: int) -> int:
        return k * STRIPE

    @property
    def fetch_add_word(self) -> int:
        return self.counters * STRIPE

    @property
    def record(self) -> int:        # [value, token] of the lock-protected read-modify-write
        return (self.counters + 1) * STRIPE


@dataclass
class Final:
    """The state read after the run (None: it could not be read, and why)."""

    counters: list[int] | None = None
    fetch_add: int | None = None
    record: int | None = None
    error: str = ""


@dataclass
class History:
    seed: int
    ops: list[Op] = field(default_factory=list)
    final: Final = field(default_factory=Final)
    nemesis: list[tuple[float, str]] = field(default_factory=list)

    def dump(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(json.dumps({"seed": self.seed, "final": asdict(self.final), "nemesis": self.nemesis}) + "\n")
            for op in self.ops:
                f.write(json.dumps(asdict(op)) + "\n")
