# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Sans-IO hot paths of smb2: no asyncio, no sockets, no verbs.

* the fixed 32-byte frame header (encode/decode),
* the stripe planner (which server holds which byte of a buffer),
* typed accumulate kernels (``dst += src`` elementwise, GIL released),
* the buffer-name hash that picks a buffer's first server.

Everything here is a pure function of its arguments so that it can be tested
against a plain-Python reference (tests/test_core.py) with hypothesis.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t, int64_t
from libc.string cimport memcpy
from cpython.array cimport array, clone

# --------------------------------------------------------------------------
# Frame header
#
#   offset size field
#        0    2 magic       0x3253 ("S2" on the wire, little endian)
#        2    1 version
#        3    1 op
#        4    2 flags
#        6    2 status      0 = ok, else an ErrorCode (replies only)
#        8    4 request id
#       12    4 segment
#       16    8 offset
#       24    8 length      payload bytes that follow, or bytes asked for (READ)
#
# All fields little endian; docs/protocol.md is the written contract.

cdef enum:
    _HEADER_SIZE = 32
    _MAGIC = 0x3253

HEADER_SIZE = _HEADER_SIZE
MAGIC = _MAGIC

cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    /* x86 and aarch64 are little endian; memcpy keeps unaligned access defined. */
    static inline void smb2_put16(char *p, uint16_t v) { memcpy(p, &v, 2); }
    static inline void smb2_put32(char *p, uint32_t v) { memcpy(p, &v, 4); }
    static inline void smb2_put64(char *p, uint64_t v) { memcpy(p, &v, 8); }
    static inline uint16_t smb2_get16(const char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
    static inline uint32_t smb2_get32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
    static inline uint64_t smb2_get64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
    """
    void smb2_put16(char *p, uint16_t v) nogil
    void smb2_put32(char *p, uint32_t v) nogil
    void smb2_put64(char *p, uint64_t v) nogil
    uint16_t smb2_get16(const char *p) nogil
    uint32_t smb2_get32(const char *p) nogil
    uint64_t smb2_get64(const char *p) nogil


cdef inline void _put_header(char *p, int version, int op, int flags, int status,
                             uint32_t request_id, uint32_t segment,
                             uint64_t offset, uint64_t length) noexcept nogil:
    smb2_put16(p, _MAGIC)
    p[2] = <char>version
    p[3] = <char>op
    smb2_put16(p + 4, <uint16_t>flags)
    smb2_put16(p + 6, <uint16_t>status)
    smb2_put32(p + 8, request_id)
    smb2_put32(p + 12, segment)
    smb2_put64(p + 16, offset)
    smb2_put64(p + 24, length)


def encode_header(int version, int op, int flags, int status, uint32_t request_id,
                  uint32_t segment, uint64_t offset, uint64_t length):
    """Return the 32-byte header as ``bytes``."""
    if not (0 <= version < 256 and 0 <= op < 256 and 0 <= flags < 65536
            and 0 <= status < 65536):
        raise ValueError("header field out of range")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 32)
    _put_header(PyBytes_AS_STRING(out), version, op, flags, status,
                request_id, segment, offset, length)
    return out


def encode_header_with(int version, int op, int flags, int status, uint32_t request_id,
                       uint32_t segment, uint64_t offset, uint64_t length,
                       const uint8_t[::1] payload):
    """Return header + a small payload (atomics' operands, control messages) as
    one ``bytes``, so that one ``transport.write`` sends one frame."""
    cdef Py_ssize_t n = payload.shape[0]
    if not (0 <= version < 256 and 0 <= op < 256 and 0 <= flags < 65536
            and 0 <= status < 65536):
        raise ValueError("header field out of range")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 32 + n)
    cdef char *p = PyBytes_AS_STRING(out)
    _put_header(p, version, op, flags, status, request_id, segment, offset, length)
    if n:
        memcpy(p + 32, &payload[0], n)
    return out


def decode_header(const uint8_t[::1] buf, Py_ssize_t pos=0):
    """Decode the header at ``buf[pos:pos+32]``.

    Returns ``(magic, version, op, flags, status, request_id, segment, offset,
    length)``; the caller validates magic and version (the receiver decides
    whether a bad frame closes the connection)."""
    if pos < 0 or buf.shape[0] - pos < 32:
        raise ValueError("need 32 bytes for a header")
    cdef const char *p = <const char *>&buf[pos]
    return (smb2_get16(p), <uint8_t>p[2], <uint8_t>p[3], smb2_get16(p + 4),
            smb2_get16(p + 6), smb2_get32(p + 8), smb2_get32(p + 12),
            smb2_get64(p + 16), smb2_get64(p + 24))


def pack_u64(uint64_t a):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 8)
    smb2_put64(PyBytes_AS_STRING(out), a)
    return out


def pack_u64x2(uint64_t a, uint64_t b):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 16)
    smb2_put64(PyBytes_AS_STRING(out), a)
    smb2_put64(PyBytes_AS_STRING(out) + 8, b)
    return out


def unpack_u64(const uint8_t[::1] buf, Py_ssize_t pos=0):
    if pos < 0 or buf.shape[0] - pos < 8:
        raise ValueError("need 8 bytes")
    return smb2_get64(<const char *>&buf[pos])


# --------------------------------------------------------------------------
# Buffer-name hash: FNV-1a 64 over the UTF-8 name. Placement must be the same
# on every client and every version, so this is fixed forever.

def name_hash(str name):
    cdef bytes b = name.encode("utf-8")
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(b)
    cdef Py_ssize_t i, n = len(b)
    cdef uint64_t h = 0xcbf29ce484222325ULL
    for i in range(n):
        h ^= p[i]
        h *= 0x100000001b3ULL
    return h


# --------------------------------------------------------------------------
# Stripe planner
#
# Stripe i of a buffer lives on server (first + i) mod N at segment offset
# (i div N) * stripe.  A server's stripes of any byte range are therefore
# contiguous in its segment, so each server gets ONE contiguous segment range
# per operation, which plan() then cuts into requests of at most max_request
# bytes.  Each request scatters to (or gathers from) one or more pieces of the
# caller's memory.
#
# Output, two flat int64 arrays (no Python object per stripe):
#   requests: [server, segment_offset, length, first_piece, n_pieces] * R
#   pieces:   [buffer_offset, length] * P      (buffer_offset is relative to
#                                               the start of the planned range)

def segment_size(uint64_t nbytes, uint64_t stripe, uint64_t nservers):
    """Bytes every server reserves for a buffer: whole stripes, the same on all
    servers (so any server can answer for the buffer's geometry)."""
    if stripe == 0 or nservers == 0:
        raise ValueError("stripe and nservers must be positive")
    cdef uint64_t nstripes = (nbytes + stripe - 1) // stripe
    return ((nstripes + nservers - 1) // nservers) * stripe


def plan(uint64_t nbytes, uint64_t stripe, uint64_t nservers, uint64_t first,
         uint64_t offset, uint64_t length, uint64_t max_request):
    """Plan the byte range ``[offset, offset+length)`` of a buffer.

    Returns ``(requests, pieces)`` as ``array('q')``; see above.  Requests come
    grouped by server (in the order the range reaches them); within a server,
    in ascending segment order."""
    if stripe == 0 or nservers == 0 or max_request == 0:
        raise ValueError("stripe, nservers and max_request must be positive")
    if offset > nbytes or length > nbytes - offset:
        raise ValueError("range outside the buffer")
    cdef array requests = array("q")
    cdef array pieces = array("q")
    if length == 0:
        return requests, pieces
    cdef uint64_t end = offset + length
    cdef uint64_t i0 = offset // stripe, i1 = (end - 1) // stripe
    cdef uint64_t server, k, i, lo, hi, seg_lo, seg_cur, req_left, take
    cdef uint64_t run_seg_start, run_left
    cdef Py_ssize_t req_first, npieces_here
    cdef uint64_t piece_buf, piece_len
    cdef int64_t last_buf_end
    for k in range(nservers if i1 - i0 + 1 >= nservers else i1 - i0 + 1):
        # stripes of this server within [i0, i1]: i0 + k, i0 + k + N, ...
        i = i0 + k
        server = (first + i) % nservers
        lo = offset if i == i0 else i * stripe
        run_seg_start = (i // nservers) * stripe + (lo - i * stripe)
        req_left = 0
        seg_cur = run_seg_start
        last_buf_end = -1
        req_first = 0
        npieces_here = 0
        # total bytes of this server's run
        while i <= i1:
            lo = offset if i == i0 else i * stripe
            hi = end if i == i1 else (i + 1) * stripe
            while lo < hi:
                if req_left == 0:
                    if npieces_here:
                        requests[len(requests) - 1] = npieces_here
                    req_first = len(pieces) // 2
                    npieces_here = 0
                    last_buf_end = -1
                    requests.extend((server, seg_cur, 0, req_first, 0))
                    req_left = max_request
                take = hi - lo
                if take > req_left:
                    take = req_left
                if <int64_t>(lo - offset) == last_buf_end:
                    # adjacent in the caller's memory too (one server): merge
                    pieces[len(pieces) - 1] += take
                else:
                    pieces.extend((lo - offset, take))
                    npieces_here += 1
                last_buf_end = lo - offset + take
                requests[len(requests) - 3] += take
                seg_cur += take
                req_left -= take
                lo += take
            i += nservers
        if npieces_here:
            requests[len(requests) - 1] = npieces_here
    return requests, pieces


# --------------------------------------------------------------------------
# Accumulate kernels: dst[i] += src[i] over n elements of one dtype.
# Codes are the wire's dtype codes (protocol.DTYPE_CODES).

DTYPE_FLOAT32 = 1
DTYPE_FLOAT64 = 2
DTYPE_INT32 = 3
DTYPE_INT64 = 4

cdef int _itemsize(int code) noexcept nogil:
    if code == 1 or code == 3:
        return 4
    if code == 2 or code == 4:
        return 8
    return 0


def dtype_itemsize(int code):
    cdef int n = _itemsize(code)
    if n == 0:
        raise ValueError(f"unknown dtype code {code}")
    return n


cdef void _acc_f32(char *d, const char *s, Py_ssize_t n) noexcept nogil:
    cdef float a, b
    cdef Py_ssize_t i
    for i in range(n):
        memcpy(&a, d + 4 * i, 4)
        memcpy(&b, s + 4 * i, 4)
        a = a + b
        memcpy(d + 4 * i, &a, 4)


cdef void _acc_f64(char *d, const char *s, Py_ssize_t n) noexcept nogil:
    cdef double a, b
    cdef Py_ssize_t i
    for i in range(n):
        memcpy(&a, d + 8 * i, 8)
        memcpy(&b, s + 8 * i, 8)
        a = a + b
        memcpy(d + 8 * i, &a, 8)


cdef void _acc_i32(char *d, const char *s, Py_ssize_t n) noexcept nogil:
    # unsigned arithmetic: wraps around like numpy's int32 instead of UB
    cdef uint32_t a, b
    cdef Py_ssize_t i
    for i in range(n):
        memcpy(&a, d + 4 * i, 4)
        memcpy(&b, s + 4 * i, 4)
        a = a + b
        memcpy(d + 4 * i, &a, 4)


cdef void _acc_i64(char *d, const char *s, Py_ssize_t n) noexcept nogil:
    cdef uint64_t a, b
    cdef Py_ssize_t i
    for i in range(n):
        memcpy(&a, d + 8 * i, 8)
        memcpy(&b, s + 8 * i, 8)
        a = a + b
        memcpy(d + 8 * i, &a, 8)


def accumulate(uint8_t[::1] dst, const uint8_t[::1] src, int code):
    """``dst += src`` elementwise, both viewed as the dtype ``code``.

    ``dst`` and ``src`` are byte views of equal length, a multiple of the
    item size.  The GIL is released: large accumulates don't stall other
    Python threads (the server's loop itself waits, which is what makes an
    accumulate atomic with respect to other requests)."""
    cdef int size = _itemsize(code)
    if size == 0:
        raise ValueError(f"unknown dtype code {code}")
    cdef Py_ssize_t nb = dst.shape[0]
    if src.shape[0] != nb:
        raise ValueError("dst and src differ in length")
    if nb % size:
        raise ValueError("length is not a multiple of the item size")
    if nb == 0:
        return
    cdef char *d = <char *>&dst[0]
    cdef const char *s = <const char *>&src[0]
    cdef Py_ssize_t n = nb // size
    with nogil:
        if code == 1:
            _acc_f32(d, s, n)
        elif code == 2:
            _acc_f64(d, s, n)
        elif code == 3:
            _acc_i32(d, s, n)
        else:
            _acc_i64(d, s, n)


def copy_into(uint8_t[::1] dst, const uint8_t[::1] src):
    """memcpy with the GIL released (used to move the part of a payload that
    arrived together with its header)."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError("dst and src differ in length")
    if dst.shape[0]:
        with nogil:
            memcpy(&dst[0], &src[0], dst.shape[0])
