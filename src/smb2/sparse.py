"""Sparse accumulate on the client: the arguments checked, the items split
into requests by server (by stripe for a replicated buffer, whose stripes
have primaries of their own), each request's indices rebased to where it
lands, and its payload laid out (docs/protocol.md, "Sparse accumulate").

``Buffer.accumulate_sparse`` is the API; this module is its stripe plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _core
from .errors import InvalidArgumentError
from .protocol import DTYPE_SHIFT, FLAG_WIDE_INDEX, SPARSE_COUNT_SIZE, WIRE_CODES, narrow_into

#: the word a sparse accumulate adds into: float32
WORD = 4
_U32_INDICES = 1 << 32


@dataclass(frozen=True, slots=True)
class Request:
    """One request: to server ``target`` (a stripe's index for a replicated
    buffer), its indices counting float32 words from ``base`` (a byte
    offset in that server's segment; within the stripe, replicated)."""

    target: int
    base: int
    payload: list[memoryview]       # the count, the indices, the values (bytes)
    flags: int
    items: int

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payload)


def _bytes(a: np.ndarray) -> memoryview:
    flat: Any = np.ascontiguousarray(a).view(np.uint8)
    return memoryview(flat)


def check(name: str, nbytes: int, offset: int, indices: Any, values: Any,
          wire: str | None) -> tuple[np.ndarray, np.ndarray, int]:
    """``(indices as int64, values as they travel, dtype code)``, or
    InvalidArgumentError in the buffer's terms: values not float32,
    lengths that disagree, an index below 0 or past the buffer's end."""
    if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.dtype.byteorder == ">":
        got = type(values).__name__ if not isinstance(values, np.ndarray) else str(values.dtype)
        raise InvalidArgumentError(f"sparse accumulate into buffer {name!r}: values must be a float32 numpy "
                                   f"array, not {got}", hint="pass values.astype(np.float32)")
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu" or idx.ndim != 1 or values.ndim != 1:
        raise InvalidArgumentError(f"sparse accumulate into buffer {name!r}: indices and values are 1-D "
                                   f"arrays (integers, float32), not {idx.dtype} of shape {idx.shape} and "
                                   f"shape {values.shape}")
    if len(idx) != len(values):
        raise InvalidArgumentError(f"sparse accumulate into buffer {name!r}: {len(idx)} indices and "
                                   f"{len(values)} values disagree in length: one value per index")
    if wire is None:
        code, sent = _core.DTYPE_FLOAT32, np.ascontiguousarray(values)
    else:
        narrow = WIRE_CODES.get(wire) if isinstance(wire, str) else None
        if narrow is None:
            raise InvalidArgumentError(f"wire must be None, {' or '.join(map(repr, WIRE_CODES))}, not {wire!r}")
        code, sent = narrow, np.empty(len(values), np.uint16)
        narrow_into(narrow, np.ascontiguousarray(values), sent)
    if offset % WORD:
        raise InvalidArgumentError(f"sparse accumulate into buffer {name!r}: offset {offset} is not "
                                   "aligned to a float32 word (4 bytes)")
    if len(idx):
        low, high = int(idx.min()), int(idx.max())
        if low < 0 or offset + WORD * (high + 1) > nbytes:
            bad = low if low < 0 else high
            raise InvalidArgumentError(
                f"sparse accumulate into buffer {name!r}: index {bad} from offset {offset} is outside the "
                f"buffer ({nbytes} bytes, {(nbytes - offset) // WORD} float32 words from there); nothing was sent")
    return idx.astype(np.int64, copy=False), sent, code


def plan(indices: np.ndarray, values: np.ndarray, code: int, offset: int, *, stripe: int, nservers: int,
         first: int, per_stripe: bool, limit: int) -> list[Request]:
    """The requests of a checked sparse accumulate: one per server (per
    stripe with ``per_stripe``) whose payload fits ``limit`` bytes, more
    where it does not.  Items keep their order within a request, so that
    duplicates add in the caller's order."""
    at = offset + WORD * indices                        # the buffer's bytes
    stripes = at // stripe
    if per_stripe:
        targets, where = stripes, at - stripes * stripe
    else:
        targets = (first + stripes) % nservers
        where = (stripes // nservers) * stripe + at % stripe
    order = np.argsort(targets, kind="stable")
    cuts = np.flatnonzero(np.diff(targets[order])) + 1
    vsize = values.itemsize
    out = []
    for group in np.split(order, cuts) if len(order) else []:
        target = int(targets[group[0]])
        words = where[group] // WORD
        vals = values[group]
        per = (limit - SPARSE_COUNT_SIZE) // (8 + vsize)    # room for u64 indices, whichever are sent
        for c in range(0, len(group), per):
            w = words[c:c + per]
            base = int(w.min())
            rel = w - base
            wide = int(rel.max()) >= _U32_INDICES
            sent_idx = rel.astype(np.uint64 if wide else np.uint32)
            flags = code << DTYPE_SHIFT | (FLAG_WIDE_INDEX if wide else 0)
            payload = [memoryview(np.uint64(len(w)).tobytes()), _bytes(sent_idx), _bytes(vals[c:c + per])]
            out.append(Request(target, WORD * base, payload, flags, len(w)))
    return out
