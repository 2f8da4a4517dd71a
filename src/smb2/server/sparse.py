"""Sparse accumulate on the server: checking an ACCUMULATE_SPARSE request
whole, then adding it.

A request (docs/protocol.md, "Sparse accumulate") names a segment and a
byte offset, the base: its indices count float32 words from there.  Every
check happens before a word changes (a count that disagrees with the
payload's length, a dtype a sparse accumulate does not take, an index past
the segment or, on a replicated buffer, past the stripe the base lies in),
so a refused request leaves the buffer as it was.  The adding is
``_core.sparse_accumulate``: one thread, because two items of one request
may name the same word.
"""

from __future__ import annotations

from .. import _core
from ..errors import ErrorCode
from ..protocol import FLAG_WIDE_INDEX, SPARSE_CODES, sparse_code
from .segment import Refused, Segment

WORD = 4


def check_header(seg: Segment, flags: int, offset: int) -> None:
    """What the header alone tells: a value dtype a sparse accumulate takes
    and an aligned base inside the segment (``Refused`` otherwise)."""
    code = sparse_code(flags)
    if code not in SPARSE_CODES:
        raise Refused(ErrorCode.BAD_REQUEST, f"sparse accumulate into buffer {seg.name!r}: its values are "
                      f"float32, bfloat16 or float16 (dtype codes {sorted(SPARSE_CODES)}), not dtype code {code}")
    if offset % WORD or offset > seg.size:
        raise Refused(ErrorCode.OUT_OF_BOUNDS if offset > seg.size else ErrorCode.BAD_REQUEST,
                      f"sparse accumulate into buffer {seg.name!r}: base offset {offset} is not a float32 "
                      f"word of this server's part ({seg.size} bytes)")


def span(seg: Segment, flags: int, offset: int, payload: memoryview | bytes,
         within: tuple[int, int] | None = None) -> tuple[int, int]:
    """The segment bytes ``[lo, hi)`` the request's indices reach, after
    checking the whole payload; ``within``: a range they must stay in (a
    replicated buffer's stripe).  ``Refused`` names the buffer."""
    check_header(seg, flags, offset)
    try:
        n, first, last = _core.sparse_span(payload, bool(flags & FLAG_WIDE_INDEX), sparse_code(flags))
    except ValueError as exc:
        raise Refused(ErrorCode.BAD_REQUEST, f"sparse accumulate into buffer {seg.name!r}: {exc}") from None
    if n == 0:
        return offset, offset
    lo, hi = offset + WORD * first, offset + WORD * last
    limit = (0, seg.size) if within is None else within
    if lo < limit[0] or hi > limit[1]:
        where = "this server's part of it" if within is None else "the stripe its base lies in"
        raise Refused(ErrorCode.OUT_OF_BOUNDS,
                      f"sparse accumulate into buffer {seg.name!r}: index {last - 1} from base offset {offset} "
                      f"reaches byte {hi}, past {where} ({limit[1]} bytes); nothing was added")
    return lo, hi


def add(seg: Segment, flags: int, offset: int, payload: memoryview | bytes) -> None:
    """Add a request :func:`span` checked (nothing is added if an index is
    out of range: the kernel checks the whole payload first too)."""
    try:
        _core.sparse_accumulate(seg.view[offset:], payload, bool(flags & FLAG_WIDE_INDEX), sparse_code(flags))
    except ValueError as exc:
        raise Refused(ErrorCode.OUT_OF_BOUNDS, f"sparse accumulate into buffer {seg.name!r}: {exc}") from None
