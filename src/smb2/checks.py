"""Checks of the integers users pass in (offsets, sizes, atomic operands,
notification slots): one wording of the error everywhere.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import numpy as np

from .errors import InvalidArgumentError

_I64 = 1 << 63
_U64 = 1 << 64


def is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    """An int or a numpy integer, and not a bool (True is an int to Python,
    never a count or an offset to smb2)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(what: str, value: object, *, low: int | None = None) -> int:
    """``value`` as an int (numpy integers accepted, bools refused), at
    least ``low`` if given; else :class:`InvalidArgumentError` naming ``what``."""
    if not is_int(value):
        raise InvalidArgumentError(f"{what} must be an integer, not {type(value).__name__}")
    v = int(value)
    if low is not None and v < low:
        raise InvalidArgumentError(f"{what} must be at least {low}, not {v}")
    return v


def check_word(what: str, value: object) -> int:
    """An operand of a 64-bit atomic: an int64 or a u64 (a u64 above 2**63
    reads back as the negative int64 with the same bits)."""
    v = check_int(what, value)
    if not -_I64 <= v < _U64:
        raise InvalidArgumentError(f"{what}={v} does not fit in 64 bits")
    return v


def to_signed(word: int) -> int:
    """A u64 word as the int64 with the same bits."""
    return word - _U64 if word >= _I64 else word
