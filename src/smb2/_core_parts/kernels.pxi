# Part of smb2._core, included by _core.pyx (which lists the parts): the
# numeric kernels: accumulate (dense and sparse), the bfloat16 and float16
# conversions, copy_into.

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

# --------------------------------------------------------------------------
# Accumulate kernels: dst[i] += src[i] over n elements.
# Codes are the wire's dtype codes (protocol.DTYPE_CODES, protocol.WIRE_CODES).
# Codes 1-4 add a delta of the destination's own dtype.  The *widening* codes
# 5 and 6 add a half-width delta into float32 words: each bfloat16 (resp.
# IEEE float16) item of src is upcast to float32 (exactly: every bf16 and f16
# value is a float32 value) and then added, so src is half dst's length.

DTYPE_FLOAT32 = 1
DTYPE_FLOAT64 = 2
DTYPE_INT32 = 3
DTYPE_INT64 = 4
DTYPE_BFLOAT16_INTO_FLOAT32 = 5
DTYPE_FLOAT16_INTO_FLOAT32 = 6

cdef int _itemsize(int code) noexcept nogil:
    # bytes of one destination item
    if code == 1 or code == 3 or code == 5 or code == 6:
        return 4
    if code == 2 or code == 4:
        return 8
    return 0


cdef int _src_itemsize(int code) noexcept nogil:
    # bytes of one source (payload) item
    if code == 5 or code == 6:
        return 2
    return _itemsize(code)


def dtype_sizes(int code):
    """``(destination item bytes, source item bytes)`` of dtype ``code``:
    equal for codes 1-4, ``(4, 2)`` for the widening codes."""
    cdef int n = _itemsize(code)
    if n == 0:
        raise ValueError(f"unknown dtype code {code}")
    return n, _src_itemsize(code)


# One kernel for every dtype.  Integers are added as unsigned so that they
# wrap around like numpy's instead of overflowing (undefined in C); memcpy
# keeps unaligned payload views defined, and compiles to plain loads.
ctypedef fused _elem:
    float
    double
    uint32_t
    uint64_t


cdef void _acc(_elem kind, char *d, const char *s, Py_ssize_t n) noexcept nogil:
    cdef _elem a, b
    cdef Py_ssize_t i, k = sizeof(_elem)
    for i in range(n):
        memcpy(&a, d + k * i, k)
        memcpy(&b, s + k * i, k)
        a = a + b
        memcpy(d + k * i, &a, k)


# Half-width floats <-> float32, on bit patterns.  Rounding is IEEE round to
# nearest, ties to even (what torch's and numpy's casts do); a value too
# large for the narrow type becomes +-inf; NaN stays NaN (made quiet, sign
# kept); signed zeros and infinities are kept.  bfloat16 is the top half of a
# float32 (same exponent range), so only the mantissa is rounded; float16
# has a 5-bit exponent: values under 2**-14 become subnormals, and under
# 2**-25 (exactly 2**-25 too: a tie, to even) zero.
cdef extern from "smb2_half.h":
    uint16_t smb2_f32_to_bf16(uint32_t x) nogil
    uint32_t smb2_bf16_to_f32(uint16_t h) nogil
    uint16_t smb2_f32_to_f16(uint32_t x) nogil
    uint32_t smb2_f16_to_f32(uint16_t h) nogil


cdef void _acc_widening(bint bf16, char *d, const char *s, Py_ssize_t n) noexcept nogil:
    # one loop per type, no test per item: the bf16 one vectorizes
    cdef float a, b
    cdef uint16_t h
    cdef uint32_t u
    cdef Py_ssize_t i
    if bf16:
        for i in range(n):
            memcpy(&h, s + 2 * i, 2); u = smb2_bf16_to_f32(h); memcpy(&b, &u, 4)
            memcpy(&a, d + 4 * i, 4); a = a + b; memcpy(d + 4 * i, &a, 4)
    else:
        for i in range(n):
            memcpy(&h, s + 2 * i, 2); u = smb2_f16_to_f32(h); memcpy(&b, &u, 4)
            memcpy(&a, d + 4 * i, 4); a = a + b; memcpy(d + 4 * i, &a, 4)


cdef enum:
    # a part of a parallel accumulate is at least this many destination
    # bytes unless the caller says otherwise: waking a worker costs a few
    # us, adding 256 KiB ~15-50 us
    _PARALLEL_ACCUMULATE = 262144
PARALLEL_ACCUMULATE = _PARALLEL_ACCUMULATE


cdef struct _AccumulateJob:
    char *d                 # this job's destination items
    const char *s           # ... and the source items added to them
    Py_ssize_t n            # how many
    int code


cdef void *_accumulate_job(void *job) noexcept nogil:
    cdef _AccumulateJob *j = <_AccumulateJob *>job
    if j.code == 1:
        _acc(<float>0, j.d, j.s, j.n)
    elif j.code == 2:
        _acc(<double>0, j.d, j.s, j.n)
    elif j.code == 3:
        _acc(<uint32_t>0, j.d, j.s, j.n)
    elif j.code == 4:
        _acc(<uint64_t>0, j.d, j.s, j.n)
    else:
        _acc_widening(j.code == 5, j.d, j.s, j.n)
    return NULL


def accumulate(uint8_t[::1] dst, const uint8_t[::1] src, int code, int threads=1,
               Py_ssize_t min_part=_PARALLEL_ACCUMULATE):
    """``dst += src`` elementwise, dst viewed as the dtype ``code``.

    ``dst`` and ``src`` are byte views; dst's length is a multiple of the
    item size.  For codes 1-4 src is the same dtype and length; for the
    widening codes src holds one bfloat16 (5) or float16 (6) per float32 of
    dst, upcast before the add.  The GIL is released: large accumulates don't
    stall other Python threads (the server's loop itself waits, which is what
    makes an accumulate atomic with respect to other requests).

    ``threads`` > 1: a large accumulate is cut into that many parts (each at
    least ``min_part`` destination bytes, so fewer for a smaller one),
    added by this thread and the pool's (see _run_jobs), and returns once
    all are done.  Each item is still added once, by the
    same instruction: the result is bit for bit that of one thread.
    Returns the number of parts (1: this thread added it alone)."""
    cdef int size = _itemsize(code)
    if size == 0:
        raise ValueError(f"unknown dtype code {code}")
    if threads < 1 or min_part < 1:
        raise ValueError(f"threads and min_part must be at least 1, not {threads} and {min_part}")
    cdef int ssize = _src_itemsize(code)
    cdef Py_ssize_t nb = dst.shape[0]
    if nb % size:
        raise ValueError("length is not a multiple of the item size")
    cdef Py_ssize_t n = nb // size
    if src.shape[0] != n * ssize:
        raise ValueError(f"src has {src.shape[0]} bytes; {n} items of dtype code {code} "
                         f"need {n * ssize}")
    if n == 0:
        return 1
    cdef _AccumulateJob jobs[_MAX_THREADS]
    cdef Py_ssize_t lo, hi
    cdef int t, k = threads
    if k > nb // min_part:
        k = <int>(nb // min_part)
    if k > _MAX_THREADS:
        k = _MAX_THREADS
    if k < 1:
        k = 1
    cdef char *d = <char *>&dst[0]
    cdef const char *s = <const char *>&src[0]
    for t in range(k):
        # parts start on a multiple of 64 items: whole cache lines of the
        # destination, so that two threads never write one line
        lo = (n * t // k) & ~(<Py_ssize_t>63)
        hi = (n * (t + 1) // k) & ~(<Py_ssize_t>63) if t + 1 < k else n
        jobs[t].d, jobs[t].s, jobs[t].n, jobs[t].code = d + lo * size, s + lo * ssize, hi - lo, code
    with nogil:
        _run_jobs(jobs, sizeof(_AccumulateJob), k, _accumulate_job)
    return k


# --------------------------------------------------------------------------
# Sparse accumulate: dst's float32 words at element indices += values.
# A payload (docs/protocol.md, ACCUMULATE_SPARSE) is a u64 count n, then n
# indices (u32, or u64 when ``wide``), then n values: float32 (code 1), or
# bfloat16 / float16 (codes 5 and 6) widened into float32 words as the dense
# widening accumulate does.  An index counts float32 words from dst's start.

cdef int _sparse_value_size(int code) noexcept nogil:
    if code == 1:
        return 4
    if code == 5 or code == 6:
        return 2
    return 0


cdef Py_ssize_t _sparse_count(const uint8_t[::1] payload, bint wide, int code) except -1:
    # the item count, after checking that the payload's length agrees with it
    cdef int vsize = _sparse_value_size(code)
    if vsize == 0:
        raise ValueError(f"sparse accumulate adds float32, bfloat16 or float16 values into float32 "
                         f"words, not dtype code {code}")
    cdef Py_ssize_t nb = payload.shape[0]
    if nb < 8:
        raise ValueError(f"a sparse accumulate's payload starts with a u64 count; it has {nb} bytes")
    cdef uint64_t n
    memcpy(&n, &payload[0], 8)
    cdef uint64_t per = (8 if wide else 4) + vsize
    if n > <uint64_t>(nb - 8) // per or 8 + n * per != <uint64_t>nb:
        raise ValueError(f"a sparse accumulate of {n} items needs {n} indices and {n} values: "
                         f"{8 + n * per if n <= <uint64_t>nb else 'more than ' + str(nb)} bytes of payload, "
                         f"and it has {nb} (the indices and values disagree in length)")
    return <Py_ssize_t>n


cdef inline uint64_t _index_at(const char *p, bint wide, Py_ssize_t i) noexcept nogil:
    cdef uint64_t v64
    cdef uint32_t v32
    if wide:
        memcpy(&v64, p + 8 * i, 8)
        return v64
    memcpy(&v32, p + 4 * i, 4)
    return v32


def sparse_span(const uint8_t[::1] payload, bint wide, int code):
    """``(count, lowest index, highest index + 1)`` of a sparse accumulate's
    payload (``(0, 0, 0)`` when it has no items).  ValueError, with a
    message for the sender, when the dtype is not one a sparse accumulate
    takes or the payload's length disagrees with its count."""
    cdef Py_ssize_t n = _sparse_count(payload, wide, code)
    if n == 0:
        return 0, 0, 0
    cdef const char *idx = <const char *>&payload[8]
    cdef uint64_t lo = 0xFFFFFFFFFFFFFFFF, hi = 0, v
    cdef Py_ssize_t i
    with nogil:
        for i in range(n):
            v = _index_at(idx, wide, i)
            if v < lo:
                lo = v
            if v > hi:
                hi = v
    if hi == 0xFFFFFFFFFFFFFFFF:
        raise ValueError("a sparse accumulate's index 2**64-1 is past any buffer")
    return n, lo, hi + 1


def sparse_accumulate(uint8_t[::1] dst, const uint8_t[::1] payload, bint wide, int code):
    """``dst.view(float32)[indices] += values``, every duplicate index adding
    its own value, in the payload's order (the payload as :func:`sparse_span`
    reads it).  The whole payload is checked first: an index past dst's
    words raises ValueError and nothing is added.

    One thread, on purpose: two items of one request may name the same word,
    so parts of a request added by different threads could lose an add (the
    dense kernel cuts on cache lines because its items never collide).  The
    GIL is released."""
    cdef Py_ssize_t n = _sparse_count(payload, wide, code)
    if n == 0:
        return
    cdef uint64_t words = <uint64_t>(dst.shape[0] // 4)
    cdef const char *idx = <const char *>&payload[8]
    cdef const char *vals = idx + n * (8 if wide else 4)
    cdef char *d = <char *>&dst[0]
    cdef Py_ssize_t i, bad = -1
    cdef uint64_t at
    cdef float a, b
    cdef uint16_t h
    cdef uint32_t u
    with nogil:
        for i in range(n):
            if _index_at(idx, wide, i) >= words:
                bad = i
                break
        if bad < 0:
            for i in range(n):
                at = 4 * _index_at(idx, wide, i)
                if code == 1:
                    memcpy(&b, vals + 4 * i, 4)
                else:
                    memcpy(&h, vals + 2 * i, 2)
                    u = smb2_bf16_to_f32(h) if code == 5 else smb2_f16_to_f32(h)
                    memcpy(&b, &u, 4)
                memcpy(&a, d + at, 4)
                a = a + b
                memcpy(d + at, &a, 4)
    if bad >= 0:
        raise ValueError(f"index {_index_at(idx, wide, bad)} (item {bad}) is past the {words} float32 "
                         "words it may add to")


def to_bfloat16(src, out):
    """Round float32 ``src`` to bfloat16 bit patterns in ``out`` (uint16, as
    many items): round to nearest, ties to even; too large -> +-inf; NaN
    stays NaN (quiet, sign kept).  Both are C-contiguous buffers of any
    dtype (their bytes count).  GIL released."""
    _convert(src, out, _TO_BF16, "to_bfloat16")


def to_float16(src, out):
    """Round float32 ``src`` to IEEE float16 bit patterns in ``out``, by the
    same rules (numpy's ``astype(np.float16)`` agrees on every non-NaN
    value).  GIL released."""
    _convert(src, out, _TO_F16, "to_float16")


def from_bfloat16(src, out):
    """Widen bfloat16 bit patterns ``src`` (uint16) into float32 ``out``
    (exact).  GIL released."""
    _convert(src, out, _FROM_BF16, "from_bfloat16")


def from_float16(src, out):
    """Widen IEEE float16 bit patterns ``src`` into float32 ``out`` (exact).
    GIL released."""
    _convert(src, out, _FROM_F16, "from_float16")


cdef enum:
    _TO_BF16, _TO_F16, _FROM_BF16, _FROM_F16


cdef _convert(src, out, int how, str what):
    cdef bint narrowing = how == _TO_BF16 or how == _TO_F16
    cdef int src_item = 4 if narrowing else 2, out_item = 2 if narrowing else 4
    try:
        s_view = memoryview(src).cast("B")
        o_view = memoryview(out).cast("B")
    except TypeError as exc:
        raise ValueError(f"{what}: src and out must be C-contiguous buffers ({exc})") from None
    if o_view.readonly:
        raise ValueError(f"{what}: out is read-only")
    if len(s_view) % src_item or len(o_view) * src_item != len(s_view) * out_item:
        raise ValueError(f"{what}: src has {len(s_view)} bytes and out {len(o_view)}; need "
                         f"{src_item}-byte items in src and as many {out_item}-byte items in out")
    cdef Py_ssize_t i, n = len(s_view) // src_item
    if n == 0:
        return
    cdef const uint8_t[::1] sb = s_view
    cdef uint8_t[::1] ob = o_view
    cdef const char *s = <const char *>&sb[0]
    cdef char *o = <char *>&ob[0]
    cdef uint32_t u
    cdef uint16_t h
    # one loop per conversion, no test per item: the bf16 ones vectorize
    with nogil:
        if how == _TO_BF16:
            for i in range(n):
                memcpy(&u, s + 4 * i, 4); h = smb2_f32_to_bf16(u); memcpy(o + 2 * i, &h, 2)
        elif how == _TO_F16:
            for i in range(n):
                memcpy(&u, s + 4 * i, 4); h = smb2_f32_to_f16(u); memcpy(o + 2 * i, &h, 2)
        elif how == _FROM_BF16:
            for i in range(n):
                memcpy(&h, s + 2 * i, 2); u = smb2_bf16_to_f32(h); memcpy(o + 4 * i, &u, 4)
        else:
            for i in range(n):
                memcpy(&h, s + 2 * i, 2); u = smb2_f16_to_f32(h); memcpy(o + 4 * i, &u, 4)


# below this, releasing and taking back the GIL costs more than the copy
cdef enum:
    _NOGIL_COPY = 65536


def copy_into(uint8_t[::1] dst, const uint8_t[::1] src):
    """memcpy, with the GIL released for large copies (a payload that arrived
    together with its header; the shm transport's reads and writes)."""
    cdef Py_ssize_t n = dst.shape[0]
    if n != src.shape[0]:
        raise ValueError("dst and src differ in length")
    if n >= _NOGIL_COPY:
        with nogil:
            memcpy(&dst[0], &src[0], n)
    elif n:
        memcpy(&dst[0], &src[0], n)
