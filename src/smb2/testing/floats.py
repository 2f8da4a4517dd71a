"""Plain-numpy references for the half-width floats that ``accumulate(wire=...)``
sends (bfloat16, IEEE float16), and hypothesis strategies for float32 bit
patterns that reach their corner cases (NaN, inf, subnormals, rounding ties).
Shared by the kernel tests (test_core.py) and the end-to-end ones
(test_accumulate.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, by the definition of round to
    nearest, ties to even: keep the top 16 bits, round up when the dropped
    16 are over half, or exactly half and the kept part is odd.  NaN -> a
    quiet NaN of the same sign."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    kept, dropped = u >> 16, u & 0xFFFF
    up = (dropped > 0x8000) | ((dropped == 0x8000) & (kept & 1 == 1))
    out = (kept + up).astype(np.uint16)           # a carry runs into the exponent, up to inf
    nan = np.isnan(x)
    out[nan] = kept[nan] | 0x0040
    return out


def float16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE float16 bit patterns: numpy's cast (round to nearest
    even).  NaN payloads are not compared (see ``same_floats``)."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(x, np.float32).astype(np.float16).view(np.uint16)


def widen(bits: np.ndarray, wire: str) -> np.ndarray:
    """Half-width bit patterns -> float32 (exact)."""
    if wire == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


NARROW = {"bfloat16": bfloat16_bits, "float16": float16_bits}


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical float arrays, except that any NaN matches any NaN."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(nan_a, nan_b)
                and np.array_equal(a[~nan_a].view(np.uint32 if a.itemsize == 4 else np.uint16),
                                   b[~nan_b].view(np.uint32 if b.itemsize == 4 else np.uint16)))


def _f32(sign: int, exponent: int, mantissa: int) -> int:
    return sign << 31 | exponent << 23 | mantissa


# One float32 bit pattern: anything at all (NaNs with payloads, infinities,
# float32 subnormals), hypothesis's edge-seeking floats, and values exactly
# half way between two neighbours of each narrow type.
FLOAT32_BITS = st.one_of(
    st.integers(0, 2**32 - 1),
    st.floats(width=32, allow_subnormal=True).map(lambda f: int(np.float32(f).view(np.uint32))),
    # bfloat16 ties: the dropped 16 bits are exactly 0x8000
    st.integers(0, 2**16 - 1).map(lambda k: k << 16 | 0x8000),
    # float16 ties among normals (float16's exponent range, 2**-14 .. 2**15) ...
    st.builds(lambda s, e, m: _f32(s, e, m << 13 | 0x1000), st.integers(0, 1), st.integers(113, 142),
              st.integers(0, 2**10 - 1)),
    # ... and among subnormals: (2q+1) * 2**-25, half way between q and q+1 units
    st.builds(lambda s, q: int(np.float32((2 * q + 1) * 2.0**-25 * (-1) ** s).view(np.uint32)),
              st.integers(0, 1), st.integers(0, 2**10)),
)


def float32_arrays(max_size: int = 64) -> st.SearchStrategy[np.ndarray]:
    """float32 arrays drawn from FLOAT32_BITS."""
    return hnp.arrays(np.uint32, st.integers(0, max_size), elements=FLOAT32_BITS).map(
        lambda a: a.view(np.float32))
