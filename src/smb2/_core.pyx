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
from libc.stdlib cimport calloc, free

from collections import deque
from heapq import heappop, heappush

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
cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    static inline uint16_t smb2_f32_to_bf16(uint32_t x) {
        if ((x & 0x7fffffffu) > 0x7f800000u)          /* NaN: quiet it */
            return (uint16_t)((x >> 16) | 0x0040u);
        /* + 0x7fff rounds half down, + 0x8000 half up: the lowest kept bit
           picks, which is ties to even; a carry moves into the exponent,
           up to inf, as it must */
        return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    }
    static inline uint32_t smb2_bf16_to_f32(uint16_t h) { return (uint32_t)h << 16; }

    /* float16 branch-free (masks, not branches: the loops vectorize), after
       F. Giesen's float_to_half_fast3_rtne and half_to_float; checked equal
       to a plain branchy version on all 2**32 float32 inputs.  The FPU does
       the subnormal rounding (round to nearest even, the default mode; with
       denormals-are-zero set, float32 subnormal inputs still give 0, right). */
    static inline uint16_t smb2_f32_to_f16(uint32_t x) {
        uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu, aligned;
        float f;
        /* below 2**-14 the result is subnormal: adding 0.5 leaves the value
           in units of 2**-24 (rounded) in the low mantissa bits */
        memcpy(&f, &a, 4);
        f += 0.5f;
        memcpy(&aligned, &f, 4);
        uint32_t subnormal = aligned - 0x3f000000u;
        /* normal: rebias 127 -> 15 and round 23 -> 10 bits; a carry moves
           into the exponent, and at 65520 or more on to inf */
        uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
        uint32_t is_nan = -(uint32_t)(a > 0x7f800000u);
        uint32_t special = 0x7c00u | (is_nan & (0x0200u | ((a >> 13) & 0x3ffu)));  /* inf, quiet NaN */
        uint32_t big = -(uint32_t)(a >= 0x47800000u), small = -(uint32_t)(a < 0x38800000u);
        return (uint16_t)(sign | (big & special) | (~big & ((small & subnormal) | (~small & normal))));
    }
    static inline uint32_t smb2_f16_to_f32(uint16_t h) {
        uint32_t exp = ((uint32_t)h << 13) & 0x0f800000u;
        uint32_t o = (((uint32_t)h & 0x7fffu) << 13) + 0x38000000u;     /* rebias 15 -> 127 */
        /* a subnormal m * 2**-24 is (2**-14 + m * 2**-24) - 2**-14, exactly */
        uint32_t sub = o + 0x00800000u;
        float f;
        memcpy(&f, &sub, 4);
        f -= 6.103515625e-05f;
        memcpy(&sub, &f, 4);
        uint32_t infnan = -(uint32_t)(exp == 0x0f800000u), zero = -(uint32_t)(exp == 0);
        o = (infnan & (o + 0x38000000u)) | (zero & sub) | (~(infnan | zero) & o);
        return o | ((uint32_t)(h & 0x8000u) << 16);
    }
    """
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


# Work cut among threads (a large accumulate, a large copy on a mapping)
# runs on one pool per process: workers started on first need and kept,
# parked on a condition variable between batches.  Starting a thread per
# call cost 30 us on a quiet machine and 80-95 us on a loaded 2-core one,
# against 100-250 us for the add of a 4 MiB request; waking a parked one
# costs a few.  The caller takes jobs too, from the same counter, so a
# batch never waits for a worker the scheduler has not run yet: on a busy
# machine the caller ends up doing every job itself, at the cost of one
# thread, not of a thread's wait.  One batch at a time: a call that finds
# the pool busy (another thread's batch) runs its jobs itself.
cdef extern from *:
    """
    #include <pthread.h>
    #include <signal.h>
    #include <stdint.h>

    typedef void *(*smb2_job_fn)(void *);

    /* the fields below change only under smb2_pool_mu */
    static pthread_mutex_t smb2_pool_mu = PTHREAD_MUTEX_INITIALIZER;
    static pthread_cond_t smb2_pool_go = PTHREAD_COND_INITIALIZER;    /* a batch is posted */
    static pthread_cond_t smb2_pool_done = PTHREAD_COND_INITIALIZER;  /* its last job ended */
    static pthread_mutex_t smb2_pool_busy = PTHREAD_MUTEX_INITIALIZER;  /* one batch at a time */
    static int smb2_pool_workers = 0;
    static int smb2_pool_forks_handled = 0;
    static unsigned long smb2_pool_gen = 0;     /* batches posted */
    static smb2_job_fn smb2_pool_fn;
    static char *smb2_pool_jobs;
    static size_t smb2_pool_job_size;
    static int smb2_pool_k, smb2_pool_next, smb2_pool_left;

    /* under smb2_pool_mu: run the posted batch's jobs until none is left to take */
    static void smb2_pool_take(void) {
        while (smb2_pool_next < smb2_pool_k) {
            char *job = smb2_pool_jobs + (size_t)smb2_pool_next++ * smb2_pool_job_size;
            smb2_job_fn fn = smb2_pool_fn;
            pthread_mutex_unlock(&smb2_pool_mu);
            fn(job);
            pthread_mutex_lock(&smb2_pool_mu);
            if (--smb2_pool_left == 0)
                pthread_cond_signal(&smb2_pool_done);
        }
    }

    static void *smb2_pool_worker(void *arg) {
        /* the batch posted before this worker was started: it joins the next */
        unsigned long seen = (unsigned long)(uintptr_t)arg;
        sigset_t all;
        sigfillset(&all);     /* signals go to the interpreter's threads */
        pthread_sigmask(SIG_BLOCK, &all, NULL);
        pthread_mutex_lock(&smb2_pool_mu);
        for (;;) {
            while (smb2_pool_gen == seen)
                pthread_cond_wait(&smb2_pool_go, &smb2_pool_mu);
            seen = smb2_pool_gen;
            smb2_pool_take();
        }
        return NULL;
    }

    /* a fork's child has no workers: it starts its own.  The locks are
       held across the fork, so none is left locked by a thread it lacks;
       the child then makes every lock and condition variable anew: a
       condition variable copied with the parent's waiters in it (the
       parked workers) counts waiters the child does not have, and glibc's
       pthread_cond_signal then waits for ever for them to leave (seen: a
       forked child hung in its first cut accumulate) */
    static void smb2_pool_prepare(void) { pthread_mutex_lock(&smb2_pool_busy); pthread_mutex_lock(&smb2_pool_mu); }
    static void smb2_pool_parent(void) { pthread_mutex_unlock(&smb2_pool_mu); pthread_mutex_unlock(&smb2_pool_busy); }
    static void smb2_pool_child(void) {
        smb2_pool_workers = 0;
        pthread_mutex_init(&smb2_pool_mu, NULL);
        pthread_mutex_init(&smb2_pool_busy, NULL);
        pthread_cond_init(&smb2_pool_go, NULL);
        pthread_cond_init(&smb2_pool_done, NULL);
    }

    /* run jobs[0..k) (each job_size bytes) with fn, on this thread and up to
       k - 1 workers; returns when all have ended */
    static void smb2_run_jobs(void *jobs, size_t job_size, int k, smb2_job_fn fn) {
        int t;
        if (k > 1 && pthread_mutex_trylock(&smb2_pool_busy) == 0) {
            pthread_mutex_lock(&smb2_pool_mu);
            if (!smb2_pool_forks_handled)
                smb2_pool_forks_handled = pthread_atfork(smb2_pool_prepare, smb2_pool_parent,
                                                         smb2_pool_child) == 0;
            while (smb2_pool_workers < k - 1) {
                pthread_t th;
                pthread_attr_t attr;
                int ok;
                pthread_attr_init(&attr);
                pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
                ok = pthread_create(&th, &attr, smb2_pool_worker, (void *)(uintptr_t)smb2_pool_gen) == 0;
                pthread_attr_destroy(&attr);
                if (!ok)
                    break;      /* fewer workers: this thread takes more jobs */
                smb2_pool_workers++;
            }
            smb2_pool_fn = fn;
            smb2_pool_jobs = (char *)jobs;
            smb2_pool_job_size = job_size;
            smb2_pool_k = k;
            smb2_pool_next = 0;
            smb2_pool_left = k;
            smb2_pool_gen++;
            for (t = 1; t < k && t <= smb2_pool_workers; t++)
                pthread_cond_signal(&smb2_pool_go);
            smb2_pool_take();
            while (smb2_pool_left > 0)
                pthread_cond_wait(&smb2_pool_done, &smb2_pool_mu);
            pthread_mutex_unlock(&smb2_pool_mu);
            pthread_mutex_unlock(&smb2_pool_busy);
            return;
        }
        for (t = 0; t < k; t++)
            fn((char *)jobs + (size_t)t * job_size);
    }
    """
    void smb2_run_jobs(void *jobs, size_t job_size, int k, void *(*fn)(void *) noexcept nogil) nogil

cdef enum:
    # the most threads one call cuts its work among (--threads above it
    # is taken as this many)
    _MAX_THREADS = 64
    # a part of a parallel accumulate is at least this many destination
    # bytes unless the caller says otherwise: waking a worker costs a few
    # us, adding 256 KiB ~15-50 us
    _PARALLEL_ACCUMULATE = 262144
MAX_THREADS = _MAX_THREADS
PARALLEL_ACCUMULATE = _PARALLEL_ACCUMULATE


cdef inline void _run_jobs(void *jobs, size_t job_size, int k,
                           void *(*run)(void *) noexcept nogil) noexcept nogil:
    # The one way work is cut among threads here (a large copy on a
    # mapping, a large accumulate): the jobs run on this thread and the
    # pool's workers (above), and all have ended when it returns, so the
    # caller sees the work done as if by one call.
    smb2_run_jobs(jobs, job_size, k, run)


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


# --------------------------------------------------------------------------
# Same-host fast path: a buffer's stripes as mapped by shm transports.
#
# Over shm a read, a write or an atomic is a memcpy or one CPU instruction
# on our own mapping, so the Python that plans it, picks the transport and
# checks the handle would cost ten times the work itself.  MappedStripes
# keeps, per server, the segment data an shm transport mapped for one
# buffer (registered by the Buffer once that transport passed the handle's
# incarnation check) and does a whole operation in one call: locate the
# stripes, check each server's transport is still open, its state word
# still LIVE and the range inside its segment, copy.  Anything else (a
# server not mapped, a closed connection, a destroyed buffer, a range
# outside the buffer, an argument of the wrong type) returns "not done"
# without touching memory, and the caller's general path runs and raises
# the proper error.
#
# Large operations copy every stripe of every server in one loop without
# the GIL, with non-temporal stores (as glibc's memcpy does for one large
# copy, but never for the 1 MiB stripes of a striped one: those went
# through the cache and ran at ~0.6x of one np.copyto of the whole).

from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE,
                             PyBUF_C_CONTIGUOUS)
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #include <xmmintrin.h>
    /* memcpy with non-temporal stores: the destination bypasses the cache */
    static void smb2_stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        if (head > n) head = n;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            /* a segment is in 4 KiB pages, where the hardware prefetcher
               stops: ask for the line 1 KiB ahead (it never faults) */
            _mm_prefetch((const char *)src + 1024, _MM_HINT_NTA);
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        memcpy(dst, src, n);
    }
    /* streamed stores are weakly ordered: visible before anything later */
    static void smb2_stream_fence(void) { _mm_sfence(); }
    #else
    static void smb2_stream_copy(uint8_t *dst, const uint8_t *src, size_t n) { memcpy(dst, src, n); }
    static void smb2_stream_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    #endif
    """
    void smb2_stream_copy(uint8_t *dst, const uint8_t *src, size_t n) nogil
    void smb2_stream_fence() nogil


cdef enum:
    # a segment's state word while its buffer exists (server/memfd.py)
    _SEGMENT_LIVE = 1
    # from this many bytes an operation streams past the cache (the size
    # where glibc's memcpy starts doing so on the development machines is
    # a few MiB; a striped copy's pieces are each below it)
    _STREAM_COPY = 4194304
    # the pause clock is read every this many operations or bytes copied
    _CLOCK_OPS = 16
    _CLOCK_BYTES = 262144


# A large copy from or to a mapping is cut among up to this many threads
# (the caller's and the pool's), each at least _PARALLEL_COPY
# bytes.  One thread reading a server's segment (a memfd in 4 KiB pages)
# reaches 0.7-0.8x of an in-process copy between huge-page arrays: it
# waits on a TLB miss every 4 KiB.  Two threads hide each other's misses
# (1.3x on the development machine's 2 cores).  The parts are jobs for the
# process's pool of threads (_run_jobs), all ended before the copy returns.
cdef enum:
    _MAX_COPY_THREADS = 4
    _PARALLEL_COPY = 4194304
MAX_COPY_THREADS = _MAX_COPY_THREADS


cdef struct _CopyJob:
    uint8_t **data          # per server: its mapped segment
    uint64_t stripe, nservers, first
    uint8_t *user           # the caller's memory, for the bytes [off, off + n)
    uint64_t off
    uint64_t lo, hi         # this job's part: the request's bytes [lo, hi)
    bint into_buffer, stream


cdef void _copy_job(_CopyJob *j) noexcept nogil:
    cdef uint64_t start = j.off + j.lo, end = j.off + j.hi
    cdef uint64_t i0 = start // j.stripe, i1 = (end - 1) // j.stripe
    cdef uint64_t i, lo, hi, s
    cdef uint8_t *mapped
    cdef uint8_t *user
    if end <= start:
        return
    for i in range(i0, i1 + 1):
        lo = start if i == i0 else i * j.stripe
        hi = end if i == i1 else (i + 1) * j.stripe
        s = (j.first + i) % j.nservers
        mapped = j.data[s] + (i // j.nservers) * j.stripe + (lo - i * j.stripe)
        user = j.user + (lo - j.off)
        if j.stream:
            if j.into_buffer:
                smb2_stream_copy(mapped, user, hi - lo)
            else:
                smb2_stream_copy(user, mapped, hi - lo)
        elif j.into_buffer:
            memcpy(mapped, user, hi - lo)
        else:
            memcpy(user, mapped, hi - lo)
    if j.stream:
        # streamed stores are weakly ordered: visible before this thread's
        # next store (and so before its join, or the caller's return)
        smb2_stream_fence()


cdef void *_copy_thread(void *job) noexcept nogil:
    _copy_job(<_CopyJob *>job)
    return NULL


cdef inline double _monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


#: what an atomic of MappedStripes returns, having done nothing, when the
#: caller must let its event loop run before it (see MappedStripes._due)
PAUSE = type("Pause", (), {"__repr__": lambda self: "PAUSE", "__slots__": ()})()
# what a copy of MappedStripes returns: not done (the general path must do
# it), done, or done and the caller must now let its event loop run (a copy
# done before a pause is as good as one done after; an atomic's result
# would be lost if the caller were cancelled in the pause)
COPY_NOT_DONE = 0
COPY_DONE = 1
COPY_DONE_PAUSE = 2
#: what an atomic of MappedStripes returns when its segment stopped being
#: LIVE while it ran (the server froze it to save, or destroyed it): the
#: atomic may or may not be in what the server keeps, so the caller must
#: raise, never do it again
TORN = type("Torn", (), {"__repr__": lambda self: "TORN", "__slots__": ()})()


cdef class LiveFlag:
    """Whether a connection is still open: a transport clears it when its
    connection closes or is lost, and MappedStripes reads it in a few
    nanoseconds (asking the transport, a chain of properties, costs about
    as much as the whole operation)."""

    cdef public bint live

    def __cinit__(self):
        self.live = True


cdef class MappedStripes:
    """One buffer's segments as mapped by this process's shm transports,
    for operations done in one call (see the comment above)."""

    cdef readonly uint64_t nbytes, stripe, nservers, first
    cdef uint8_t **data
    cdef uint64_t *size
    cdef uint64_t **state
    cdef list owners        # per server: the LiveFlag of the mapping's transport, or None
    cdef list views         # per server: the mapping (keeps the pages mapped)
    cdef double pause_every, paused_at
    cdef bint resuming
    cdef uint64_t unclocked_ops, unclocked_bytes
    #: threads a large copy may use, this one included (1 to MAX_COPY_THREADS)
    cdef public int copy_threads

    def __cinit__(self, uint64_t nbytes, uint64_t stripe, uint64_t nservers, uint64_t first,
                  double pause_every):
        if stripe == 0 or stripe % 8 or nservers == 0 or not pause_every > 0:
            raise ValueError("stripe must be a positive multiple of 8, nservers and pause_every positive")
        self.nbytes, self.stripe, self.nservers, self.first = nbytes, stripe, nservers, first
        self.data = <uint8_t **>calloc(nservers, sizeof(uint8_t *))
        self.size = <uint64_t *>calloc(nservers, sizeof(uint64_t))
        self.state = <uint64_t **>calloc(nservers, sizeof(uint64_t *))
        if self.data == NULL or self.size == NULL or self.state == NULL:
            raise MemoryError()
        self.owners = [None] * nservers
        self.views = [None] * nservers
        self.pause_every = pause_every
        self.paused_at = _monotonic()
        self.copy_threads = 1

    def __dealloc__(self):
        free(self.data)
        free(self.size)
        free(self.state)

    def attach(self, Py_ssize_t server, object mapping, uint64_t size, uint64_t state_offset,
               LiveFlag owner not None):
        """Serve ``server``'s part from ``mapping`` (a writable buffer: the
        segment's ``size`` data bytes, its state word at ``state_offset``)
        for as long as ``owner.live``."""
        cdef uint8_t[::1] whole = mapping
        if server < 0 or <uint64_t>server >= self.nservers:
            raise ValueError(f"no server {server} in {self.nservers}")
        if state_offset % 8 or state_offset + 8 > <uint64_t>whole.shape[0] or size > state_offset:
            raise ValueError("the state word must be an aligned word behind the data")
        if <size_t>&whole[0] % 8:
            raise ValueError("the mapping is not 8-byte aligned")
        self.views[server] = mapping
        self.owners[server] = owner
        self.data[server] = &whole[0]
        self.size[server] = size
        self.state[server] = <uint64_t *>&whole[state_offset]

    def detach(self, Py_ssize_t server):
        """Stop serving ``server``'s part here."""
        if 0 <= server < <Py_ssize_t>self.nservers:
            self.data[server] = NULL
            self.owners[server] = None
            self.views[server] = None

    def attached(self, Py_ssize_t server, LiveFlag owner):
        """Whether ``server``'s part is served from a mapping of ``owner``'s."""
        return 0 <= server < <Py_ssize_t>self.nservers and self.data[server] != NULL \
            and self.owners[server] is owner

    cdef bint _due(self) noexcept:
        # An operation here never suspends: a coroutine looping on them would
        # starve the rest of its event loop.  Once per ``pause_every`` an
        # atomic returns PAUSE instead, and the caller lets the loop run and
        # calls again: that call goes through whatever the time (a copy is
        # done first and returns COPY_DONE_PAUSE).  The
        # clock is read only every _CLOCK_OPS operations or _CLOCK_BYTES
        # copied: a read costs ~0.25 us on some virtual machines, as much as
        # an atomic with all its checks.
        cdef double now
        if self.resuming:
            self.resuming = False
            self.paused_at = _monotonic()
            self.unclocked_ops = self.unclocked_bytes = 0
            return False
        self.unclocked_ops += 1
        if self.unclocked_ops < _CLOCK_OPS and self.unclocked_bytes < _CLOCK_BYTES:
            return False
        self.unclocked_ops = self.unclocked_bytes = 0
        now = _monotonic()
        if now - self.paused_at >= self.pause_every:
            self.resuming = True
            return True
        return False

    cdef bint _serves(self, uint64_t server, uint64_t seg_end) except -1:
        # still ours, still open, the buffer still exists, the range inside
        if self.data[server] == NULL or self.size[server] < seg_end:
            return False
        if not (<LiveFlag>self.owners[server]).live or smb2_load64(self.state[server]) != _SEGMENT_LIVE:
            # for good: let the pages go (the general path says what happened)
            self.detach(server)
            return False
        return True

    cdef bint _offset(self, object offset, uint64_t length, uint64_t *out) except -1:
        # a plain int inside the buffer (numpy ints, bools: the general path)
        cdef long long v
        cdef int overflow = 0
        if type(offset) is not int:
            return False
        v = PyLong_AsLongLongAndOverflow(offset, &overflow)
        if overflow or v < 0 or <uint64_t>v > self.nbytes or length > self.nbytes - <uint64_t>v:
            return False
        out[0] = <uint64_t>v
        return True

    cdef void _copy_stripes(self, uint8_t *user, uint64_t off, uint64_t n,
                            bint into_buffer) noexcept nogil:
        # every stripe of [off, off + n), already checked by the caller; a
        # large copy in parts, one per thread, cut at page boundaries
        cdef _CopyJob jobs[_MAX_COPY_THREADS]
        cdef int t, k = self.copy_threads
        if k > <int>(n // _PARALLEL_COPY):
            k = <int>(n // _PARALLEL_COPY)
        if k > _MAX_COPY_THREADS:
            k = _MAX_COPY_THREADS
        if k < 1:
            k = 1
        for t in range(k):
            jobs[t].data = self.data
            jobs[t].stripe, jobs[t].nservers, jobs[t].first = self.stripe, self.nservers, self.first
            jobs[t].user, jobs[t].off = user, off
            jobs[t].lo = (n * t // k) & ~(<uint64_t>4095) if t else 0
            jobs[t].hi = (n * (t + 1) // k) & ~(<uint64_t>4095) if t + 1 < k else n
            jobs[t].into_buffer = into_buffer
            jobs[t].stream = n >= _STREAM_COPY
        _run_jobs(jobs, sizeof(_CopyJob), k, _copy_thread)

    cdef bint _still_live(self, uint64_t server) noexcept:
        # after a store: was the segment LIVE once the store was visible?
        # (the server changes the state word before it snapshots; see
        # load_after_stores)
        if smb2_load64_after_stores(self.state[server]) == _SEGMENT_LIVE:
            return True
        self.detach(server)
        return False

    cdef int _copy(self, object mem, object offset, bint into_buffer) except -1:
        # 0: not done, 1: done, 2: written, but a segment stopped being LIVE
        # meanwhile (the general path must say why; the write may be lost)
        cdef Py_buffer view
        cdef uint64_t off, n, end, i, i0, i1, k, s
        cdef bint torn = False
        try:
            PyObject_GetBuffer(mem, &view, PyBUF_C_CONTIGUOUS if into_buffer
                               else PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, TypeError, ValueError):
            return False
        try:
            n = <uint64_t>view.len
            if not self._offset(offset, n, &off):
                return False
            if n == 0:
                return True
            end = off + n
            i0 = off // self.stripe
            i1 = (end - 1) // self.stripe
            k = i1 - i0 + 1
            # each server touched: its last stripe in [i0, i1] must lie inside its segment
            for i in range(i1 + 1 - (k if k < self.nservers else self.nservers), i1 + 1):
                s = (self.first + i) % self.nservers
                if not self._serves(s, (i // self.nservers + 1) * self.stripe):
                    return False
            self.unclocked_bytes += n
            if n >= _NOGIL_COPY:
                with nogil:
                    self._copy_stripes(<uint8_t *>view.buf, off, n, into_buffer)
            else:
                self._copy_stripes(<uint8_t *>view.buf, off, n, into_buffer)
            if into_buffer:
                for i in range(i1 + 1 - (k if k < self.nservers else self.nservers), i1 + 1):
                    if not self._still_live((self.first + i) % self.nservers):
                        torn = True
            return 2 if torn else 1
        finally:
            PyBuffer_Release(&view)

    def read_into(self, object out, object offset):
        """Copy the buffer's bytes at ``offset`` into ``out``; a COPY_* code."""
        if not self._copy(out, offset, False):
            return COPY_NOT_DONE
        return COPY_DONE_PAUSE if self._due() else COPY_DONE

    def write(self, object src, object offset):
        """Copy ``src`` into the buffer at ``offset``; a COPY_* code.  A
        write during which a segment stopped being LIVE is COPY_NOT_DONE:
        the general path then finds the segment frozen or gone and raises
        (the copy may not be in what the server keeps)."""
        cdef int done = self._copy(src, offset, True)
        if done != 1:
            return COPY_NOT_DONE
        return COPY_DONE_PAUSE if self._due() else COPY_DONE

    cdef uint64_t *_word(self, object offset, uint64_t *server) except? NULL:
        cdef uint64_t off, i, s, seg
        if not self._offset(offset, 8, &off) or off % 8:
            return NULL
        i = off // self.stripe
        s = (self.first + i) % self.nservers
        seg = (i // self.nservers) * self.stripe + off % self.stripe
        if not self._serves(s, seg + 8):
            return NULL
        server[0] = s
        return <uint64_t *>(self.data[s] + seg)

    cdef bint _operand(self, object value, uint64_t *out) except -1:
        # an int64 or a u64 (check_word's range), as its 64 bits
        cdef long long v
        cdef int overflow = 0
        if type(value) is not int:
            return False
        v = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow == 0:
            out[0] = <uint64_t>v
            return True
        if overflow < 0:
            return False
        try:
            out[0] = PyLong_AsUnsignedLongLong(value)
        except OverflowError:
            return False
        return True

    def fetch_add(self, object offset, object value):
        """The int64 word at ``offset`` += ``value``: its old value (signed),
        or None where the general path must do it, or PAUSE, or TORN."""
        cdef uint64_t v, s
        cdef uint64_t *p
        cdef int64_t old
        if self._due():
            return PAUSE
        p = self._word(offset, &s)
        if p == NULL or not self._operand(value, &v):
            return None
        old = <int64_t>smb2_fetch_add64(p, v)
        return old if self._still_live(s) else TORN

    def compare_swap(self, object offset, object expected, object new):
        """Replace the int64 word at ``offset`` by ``new`` if it equals
        ``expected``: its old value (signed), or None or PAUSE as for fetch_add."""
        cdef uint64_t e, w, s
        cdef uint64_t *p
        cdef int64_t old
        if self._due():
            return PAUSE
        p = self._word(offset, &s)
        if p == NULL or not self._operand(expected, &e) or not self._operand(new, &w):
            return None
        old = <int64_t>smb2_cas64_old(p, e, w)
        return old if self._still_live(s) else TORN


# --------------------------------------------------------------------------
# The FIFO ticket lock (docs/design.md, "The lock").
#
# A lock is a 32-byte slot of a server's lock segment, four u64 words:
#
#   +0  next_ticket   acquire: t = fetch_add(next_ticket, 1)
#   +8  now_serving   the holder's ticket; release moves it to t + 1
#   +16 heartbeat     the holder bumps it to renew its lease
#   +24 reserved
#
# Tickets are u64 and wrap around, so every comparison below is on the
# signed difference of two tickets, never on their values.
#
# Two state machines live here, both sans-IO: LockTable is the server's
# view of its slots (parked waiters, abandoned tickets, leases), TicketState
# is one client's view of one acquisition (ticket, distance, backoff,
# renewal).  The asyncio layers (server/locks.py, lock.py) only move bytes
# and timers between them and the transports.

LOCK_SLOT_SIZE = 32
LOCK_NEXT = 0
LOCK_SERVING = 8
LOCK_HEARTBEAT = 16

cdef extern from *:
    """
    #include <stdint.h>
    /* The lock words are shared with one-sided clients (RDMA atomics on the
       NIC): the server's own changes are CPU atomics, never plain stores,
       so that a parked acquire and an RDMA fetch-and-add can never draw the
       same ticket.  (The IB spec only promises atomicity among the HCA's
       own atomics; on the hosts smb2 targets, including soft-RoCE, whose
       "NIC" is this CPU, CPU atomics are what it can do.) */
    static inline uint64_t smb2_fetch_add64(uint64_t *p, uint64_t v) {
        return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
    static inline int smb2_cas64(uint64_t *p, uint64_t expected, uint64_t desired) {
        return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                           __ATOMIC_SEQ_CST); }
    """
    uint64_t smb2_fetch_add64(uint64_t *p, uint64_t v) nogil
    bint smb2_cas64(uint64_t *p, uint64_t expected, uint64_t desired) nogil


cdef extern from *:
    """
    static inline uint64_t smb2_load64(uint64_t *p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
    static inline void smb2_store64(uint64_t *p, uint64_t v) {
        __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
    static inline uint64_t smb2_cas64_old(uint64_t *p, uint64_t expected, uint64_t desired) {
        __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        return expected; /* the old value, whether or not it was replaced */ }
    """
    uint64_t smb2_load64(uint64_t *p) nogil
    void smb2_store64(uint64_t *p, uint64_t v) nogil
    uint64_t smb2_cas64_old(uint64_t *p, uint64_t expected, uint64_t desired) nogil


cdef extern from *:
    """
    /* A load ordered after every store before it, streamed ones included
       (a full fence: on x86 a seq-cst load alone may pass earlier stores). */
    static inline uint64_t smb2_load64_after_stores(uint64_t *p) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
    """
    uint64_t smb2_load64_after_stores(uint64_t *p) nogil


# Word atomics on shared memory (seq-cst CPU atomics).  Every party that
# changes a word another process may change at the same time uses these:
# the server executing a TCP FETCH_ADD/COMPARE_SWAP, and a shm client on its
# own mapping of the same pages, so that the two can never lose an update.
cdef uint64_t *_word_at(uint8_t[::1] mem, Py_ssize_t offset) except NULL:
    if offset < 0 or offset % 8 or offset + 8 > mem.shape[0]:
        raise ValueError(f"no aligned 8-byte word at offset {offset} of {mem.shape[0]} bytes")
    cdef uint64_t *p = <uint64_t *>&mem[offset]
    if <size_t>p % 8:
        raise ValueError("the memory is not 8-byte aligned")
    return p


cdef uint64_t *_word_read(const uint8_t[::1] mem, Py_ssize_t offset) except NULL:
    # _word_at for what only reads the word (a load, a futex wait): it takes
    # read-only memory too, such as a shm client's mapping of a replicated
    # segment (the server hands those out unwritable)
    if offset < 0 or offset % 8 or offset + 8 > mem.shape[0]:
        raise ValueError(f"no aligned 8-byte word at offset {offset} of {mem.shape[0]} bytes")
    cdef uint64_t *p = <uint64_t *>&mem[offset]
    if <size_t>p % 8:
        raise ValueError("the memory is not 8-byte aligned")
    return p


def atomic_load(const uint8_t[::1] mem, Py_ssize_t offset):
    """The u64 word at ``offset`` of ``mem``."""
    return smb2_load64(_word_read(mem, offset))


def load_after_stores(const uint8_t[::1] mem, Py_ssize_t offset):
    """The u64 word at ``offset``, read after every store this thread made
    before is visible to all (a full fence, then a seq-cst load).  A shm
    writer reads its segment's state word so after its copy: if the word
    is still LIVE, the server, which changes the word before it snapshots
    the segment (a save), sees the whole copy (docs/reliability.md)."""
    return smb2_load64_after_stores(_word_read(mem, offset))


def atomic_store(uint8_t[::1] mem, Py_ssize_t offset, uint64_t value):
    """Store ``value`` into the u64 word at ``offset``."""
    smb2_store64(_word_at(mem, offset), value)


def atomic_fetch_add(uint8_t[::1] mem, Py_ssize_t offset, uint64_t value):
    """Add ``value`` (mod 2**64) to the u64 word at ``offset``; the old value."""
    return smb2_fetch_add64(_word_at(mem, offset), value)


def atomic_compare_swap(uint8_t[::1] mem, Py_ssize_t offset, uint64_t expected, uint64_t new):
    """Store ``new`` if the word at ``offset`` equals ``expected``; the old value."""
    return smb2_cas64_old(_word_at(mem, offset), expected, new)


cdef inline int64_t _tdiff(uint64_t a, uint64_t b) noexcept nogil:
    # a - b as a signed distance: correct across wrap-around as long as the
    # two tickets are less than 2**63 apart (they are: a queue that long
    # does not fit in any memory)
    return <int64_t>(a - b)


# The heartbeat word names the ticket that renewed it: the top 48 bits are
# the renewer's ticket (mod 2**48), the low 16 a counter that every renewal
# moves.  The server credits a renewal to the holder only when the tag is
# now_serving's, so a stale holder that keeps renewing cannot extend the
# lease of the holder that replaced it.
LOCK_TAG_SHIFT = 16
cdef uint64_t _TAG_MASK = (1ULL << 48) - 1


cdef inline uint64_t _hb_tag(uint64_t ticket) noexcept nogil:
    return (ticket & _TAG_MASK) << 16


def renewal_word(uint64_t ticket, uint64_t old):
    """The heartbeat word a holder of ``ticket`` writes over ``old``
    (compare-and-swap): its tag, and a counter that differs from old's."""
    cdef uint64_t count = (old + 1) & 0xFFFF if (old >> 16) == (ticket & _TAG_MASK) else 0
    if _hb_tag(ticket) | count == old:
        count = (count + 1) & 0xFFFF
    return _hb_tag(ticket) | count


def renews(uint64_t heartbeat, uint64_t serving):
    """True if the heartbeat word was written by the holder of ``serving``."""
    return (heartbeat >> 16) == (serving & _TAG_MASK)


cdef struct _Slot:
    uint64_t seen_serving      # now_serving / heartbeat as of last_change
    uint64_t seen_heartbeat
    uint64_t base              # the first ticket: keys of the abandoned heap
    double last_change         # when the holder last showed a sign of life
    double lease
    int64_t holder             # waiter id of the parked holder, -1 if none/unknown
    bint used


cdef class LockTable:
    """The server's lock table over one lock segment.

    ``mem`` is the segment (a writable byte buffer of ``nslots * 32`` bytes,
    8-byte aligned: the server's page-aligned mmap).  The words live THERE,
    not here, so that one-sided operations (RDMA atomics, or the generic TCP
    FETCH_ADD/COMPARE_SWAP/READ ops) and this table see the same lock; the
    table only keeps what the words cannot say: who waits (parked waiters,
    FIFO), which tickets were given up, and when each holder last renewed.

    Waiters are ints chosen by the caller (one per parked acquire); owners
    are ints too (one per connection).  Every method that can move a lock
    returns the list of waiter ids that were granted the lock by it, in
    grant order; the caller answers their parked requests.

    Costs: no operation scans a queue.  A cancelled waiter stays in its
    slot's FIFO, dead (its ``_waiters`` entry is gone), and is dropped when
    it reaches the front; abandoned tickets are a set for membership and a
    heap for pruning the passed ones.  Cancelling N waiters and skipping
    their tickets is O(N log N), not a scan of the queue per ticket."""

    cdef object _mem            # keeps the buffer alive
    cdef uint64_t *_w
    cdef _Slot *_s
    cdef readonly Py_ssize_t nslots
    cdef list _parked           # per slot: deque of (ticket, waiter) in ticket order, dead ones too
    cdef list _abandoned        # per slot: set of tickets given up, or None
    cdef list _abandoned_heap   # per slot: heap of their keys (ticket - base)
    cdef list _live             # per slot: number of live parked waiters
    cdef dict _waiters          # waiter -> [slot, ticket, owner]
    cdef dict _owners           # owner -> set of waiters
    cdef readonly list lost     # (slot, waiter) parked waiters whose ticket was passed
    # counters for stat()
    cdef readonly uint64_t grants, expired, abandoned_skips, stale_renewals, resets

    def __cinit__(self, mem, Py_ssize_t nslots):
        cdef uint8_t[::1] view = mem
        if nslots <= 0 or view.shape[0] < nslots * 32:
            raise ValueError("lock segment too small for its slots")
        if (<size_t>&view[0]) % 8:
            raise ValueError("lock segment must be 8-byte aligned")
        self._mem = mem
        self._w = <uint64_t *>&view[0]
        self._s = <_Slot *>calloc(nslots, sizeof(_Slot))
        if self._s == NULL:
            raise MemoryError()
        self.nslots = nslots
        self._parked = [None] * nslots
        self._abandoned = [None] * nslots
        self._abandoned_heap = [None] * nslots
        self._live = [0] * nslots
        self._waiters = {}
        self._owners = {}
        self.lost = []

    def __dealloc__(self):
        free(self._s)

    cdef inline uint64_t *_words(self, Py_ssize_t slot) noexcept:
        return self._w + 4 * slot

    cdef _Slot *_slot(self, Py_ssize_t slot) except NULL:
        if slot < 0 or slot >= self.nslots or not self._s[slot].used:
            raise KeyError(f"lock slot {slot} is not open")
        return &self._s[slot]

    # -- set-up ---------------------------------------------------------
    def open(self, Py_ssize_t slot, uint64_t base, double lease, double now):
        """Start using ``slot``: tickets begin at ``base`` (a server makes it
        time-based, so tokens stay monotone across its restarts)."""
        if slot < 0 or slot >= self.nslots:
            raise IndexError("lock slot out of range")
        if not lease > 0:
            raise ValueError("lease must be positive")
        cdef uint64_t *w = self._words(slot)
        cdef _Slot *s = &self._s[slot]
        w[0] = base
        w[1] = base
        w[2] = 0
        w[3] = 0
        s.seen_serving = base
        s.seen_heartbeat = 0
        s.base = base
        s.last_change = now
        s.lease = lease
        s.holder = -1
        s.used = True
        self._parked[slot] = deque()
        self._abandoned[slot] = set()
        self._abandoned_heap[slot] = []
        self._live[slot] = 0

    def idle(self, Py_ssize_t slot):
        """True if nobody holds ``slot``, waits for it or gave a ticket of
        it up: it could be closed without anyone noticing."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        return w[0] == w[1] and s.holder < 0 and self._live[slot] == 0 \
            and not self._abandoned[slot]

    def close(self, Py_ssize_t slot):
        """Stop using an idle ``slot`` (see ``idle``); it may be opened again
        for another name.  ValueError if it is not idle."""
        if not self.idle(slot):
            raise ValueError(f"lock slot {slot} is in use")
        self._s[slot].used = False
        self._parked[slot] = None
        self._abandoned[slot] = None
        self._abandoned_heap[slot] = None

    def lease_of(self, Py_ssize_t slot):
        return self._slot(slot).lease

    def set_lease(self, Py_ssize_t slot, double lease):
        if not lease > 0:
            raise ValueError("lease must be positive")
        self._slot(slot).lease = lease

    def is_open(self, Py_ssize_t slot):
        return 0 <= slot < self.nslots and self._s[slot].used

    # -- the parked (server-side waiting) path --------------------------
    def acquire(self, Py_ssize_t slot, int64_t waiter, int64_t owner, double now):
        """Take a ticket for ``waiter``; return ``(ticket, granted)``.  If not
        granted, the waiter is parked until a later call grants it."""
        cdef _Slot *s = self._slot(slot)
        if waiter in self._waiters:
            raise ValueError(f"waiter {waiter} already has a ticket")
        cdef uint64_t *w = self._words(slot)
        cdef uint64_t t = smb2_fetch_add64(&w[0], 1)
        self._waiters[waiter] = [slot, t, owner]
        self._owners.setdefault(owner, set()).add(waiter)
        if w[1] == t:
            self._grant(slot, s, waiter, now)
            return t, True
        (<object>self._parked[slot]).append((t, waiter))
        self._live[slot] += 1
        return t, False

    def release(self, Py_ssize_t slot, uint64_t ticket, double now):
        """Release by the holder of ``ticket``: ``(ok, grants)``.  Not ok
        (nothing changes) when ``ticket`` does not hold the lock: its lease
        expired, or it was released already."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        if w[1] != ticket or w[0] == w[1] or not smb2_cas64(&w[1], ticket, ticket + 1):
            return False, []
        self._forget_holder(slot, s)
        return True, self._advance(slot, now)

    def cancel(self, int64_t waiter, double now):
        """Give up whatever ``waiter`` has: a parked ticket is abandoned (the
        queue skips it), a lock it was granted is released.  Unknown waiters
        (granted and released already, or never seen) are a no-op.  O(log n):
        the parked entry stays in the FIFO, dead, until it reaches the front."""
        entry = self._waiters.get(waiter)
        if entry is None:
            return []
        cdef Py_ssize_t slot = entry[0]
        cdef uint64_t t = entry[1]
        cdef _Slot *s = &self._s[slot]
        cdef uint64_t *w = self._words(slot)
        if s.holder == waiter and w[1] == t:
            self._forget_holder(slot, s)
            smb2_cas64(&w[1], t, t + 1)
            return self._advance(slot, now)
        self._drop_waiter(waiter)
        if s.holder == waiter:
            return []           # granted, and passed since (lease expired)
        self._live[slot] -= 1
        return self.abandon(slot, t, now)

    def drop_owner(self, int64_t owner, double now):
        """The owner's connection is gone: cancel all its waiters, in ticket
        order (a holder first, so the queue moves at once)."""
        waiters = self._owners.pop(owner, None)
        if not waiters:
            return []
        grants = []
        # parked tickets become abandoned first, so that releasing a held
        # lock afterwards skips them all in one pass
        for wid in sorted(waiters, reverse=True):
            grants.extend(self.cancel(wid, now))
        return grants

    def waiter_ticket(self, int64_t waiter):
        """``(slot, ticket)`` of a waiter that has one, else None."""
        entry = self._waiters.get(waiter)
        return None if entry is None else (entry[0], entry[1])

    # -- any path ---------------------------------------------------------
    def abandon(self, Py_ssize_t slot, uint64_t ticket, double now):
        """Ticket ``ticket`` will never be used (a polling client gave up,
        or a parked waiter went away): skip it when its turn comes, or now
        if its turn has come already."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        cdef int64_t d = _tdiff(ticket, w[1])
        if d < 0 or _tdiff(ticket, w[0]) >= 0:
            return []           # passed already, or never issued
        if d == 0:
            self._forget_holder(slot, s)
            smb2_cas64(&w[1], ticket, ticket + 1)
            return self._advance(slot, now)
        gone = <set>self._abandoned[slot]
        if ticket not in gone:
            gone.add(ticket)
            heappush(<list>self._abandoned_heap[slot], _tdiff(ticket, s.base))
        return []

    def poke(self, Py_ssize_t slot, double now):
        """The words of ``slot`` were changed behind the table's back (a
        generic atomic op): grant or skip whatever is now due."""
        cdef _Slot *s = self._slot(slot)
        return self._advance(slot, now)

    def sweep(self, double now):
        """Periodic: notice one-sided changes (renewals, releases), expire
        holders whose lease ran out, skip abandoned tickets.  Returns the
        grants; ``expired`` counts the expiries so far.  A heartbeat not
        tagged with now_serving's ticket (``renews``) is a stale holder's:
        it is counted in ``stale_renewals`` and extends nothing."""
        cdef Py_ssize_t i
        cdef _Slot *s
        cdef uint64_t *w
        grants = []
        for i in range(self.nslots):
            s = &self._s[i]
            if not s.used:
                continue
            w = self._words(i)
            if w[1] != s.seen_serving:
                s.seen_serving = w[1]
                s.seen_heartbeat = w[2]
                s.last_change = now
                grants.extend(self._advance(i, now))
                continue
            if w[2] != s.seen_heartbeat:
                s.seen_heartbeat = w[2]
                if (w[2] >> 16) == (w[1] & _TAG_MASK):
                    s.last_change = now
                    continue
                self.stale_renewals += 1
            if w[0] != w[1] and now - s.last_change >= s.lease:
                # the holder of now_serving showed no sign of life for a
                # whole lease: move the queue past it.  Its fenced writes
                # are refused from now on (check_fence).
                if smb2_cas64(&w[1], s.seen_serving, s.seen_serving + 1):
                    self.expired += 1
                    self._forget_holder(i, s)
                # else it moved under us (a late release): that is a sign of
                # life too, and the next sweep sees it
                s.seen_serving = w[1]
                s.seen_heartbeat = w[2]
                s.last_change = now
                grants.extend(self._advance(i, now))
        return grants

    def impossible(self, uint64_t max_queue):
        """The open slots whose words no client following the rules could
        have made: now_serving past next_ticket, or more than ``max_queue``
        tickets outstanding (a client wrote them with plain atomics).  One
        pass over the slots, in C."""
        cdef Py_ssize_t i
        cdef uint64_t *w
        cdef int64_t d
        out = []
        for i in range(self.nslots):
            if self._s[i].used:
                w = self._words(i)
                d = _tdiff(w[0], w[1])
                if d < 0 or <uint64_t>d > max_queue:
                    out.append(i)
        return out

    def reset(self, Py_ssize_t slot, uint64_t base, double now):
        """Number ``slot``'s tickets again from ``base`` (its words were
        made impossible, see ``impossible``): the live parked waiters keep
        their order with new tickets, the first of them granted; a holder
        loses the lock (its token no longer fences), and tickets drawn
        one-sidedly are passed (their waiters draw again).  Returns the
        grants, as every method that moves a lock does."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        cdef uint64_t old, k = 0
        live = [p for p in <object>self._parked[slot] if self._is_live(p)]
        self._forget_holder(slot, s)
        # next_ticket first (a shm client may draw meanwhile: it then gets a
        # ticket of the new numbering), now_serving last
        while True:
            old = smb2_load64(&w[0])
            if smb2_cas64(&w[0], old, base + <uint64_t>len(live)):
                break
        smb2_store64(&w[2], 0)
        fifo = deque()
        for t, wid in live:
            (<list>self._waiters[wid])[1] = base + k
            fifo.append((base + k, wid))
            k += 1
        self._parked[slot] = fifo
        self._live[slot] = len(live)
        self._abandoned[slot] = set()
        self._abandoned_heap[slot] = []
        s.base = base
        smb2_store64(&w[1], base)
        s.seen_serving = base
        s.seen_heartbeat = 0
        s.last_change = now
        self.resets += 1
        return self._advance(slot, now)

    def next_deadline(self):
        """The earliest time a lease can expire, or None when no lock is held."""
        cdef Py_ssize_t i
        cdef double best = -1
        cdef uint64_t *w
        for i in range(self.nslots):
            if self._s[i].used:
                w = self._words(i)
                if w[0] != w[1]:
                    d = self._s[i].last_change + self._s[i].lease
                    if best < 0 or d < best:
                        best = d
        return None if best < 0 else best

    def lease_deadline(self, Py_ssize_t slot):
        """When the holder of ``slot`` loses it unless it shows a sign of
        life first, or None when nobody holds it (the server's metrics time
        a hand-off after an expiry from here)."""
        cdef _Slot *s = self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        return None if w[0] == w[1] else s.last_change + s.lease

    def check_fence(self, Py_ssize_t slot, uint64_t token):
        """True if ``token`` holds the lock right now."""
        if not (0 <= slot < self.nslots and self._s[slot].used):
            return False
        cdef uint64_t *w = self._words(slot)
        return w[1] == token and w[0] != w[1]

    def words(self, Py_ssize_t slot):
        """``(next_ticket, now_serving, heartbeat)``."""
        self._slot(slot)
        cdef uint64_t *w = self._words(slot)
        return w[0], w[1], w[2]

    def parked(self, Py_ssize_t slot):
        """Live parked ``(ticket, waiter)`` pairs in FIFO order (O(n): for
        tests and statistics; ``parked_count`` is O(1))."""
        self._slot(slot)
        return [p for p in <object>self._parked[slot] if self._is_live(p)]

    def parked_count(self, Py_ssize_t slot):
        self._slot(slot)
        return self._live[slot]

    def abandoned(self, Py_ssize_t slot):
        self._slot(slot)
        return sorted(<object>self._abandoned[slot])

    def holder(self, Py_ssize_t slot):
        """Waiter id of the parked-path holder, or None."""
        cdef _Slot *s = self._slot(slot)
        return None if s.holder < 0 else s.holder

    # -- internals --------------------------------------------------------
    cdef bint _is_live(self, tuple entry):
        # a parked entry is live while its waiter still waits with that ticket
        e = self._waiters.get(entry[1])
        return e is not None and e[1] == entry[0]

    cdef void _grant(self, Py_ssize_t slot, _Slot *s, int64_t waiter, double now):
        s.holder = waiter
        s.seen_serving = self._words(slot)[1]
        s.seen_heartbeat = self._words(slot)[2]
        s.last_change = now     # the lease runs from the grant
        self.grants += 1

    cdef void _forget_holder(self, Py_ssize_t slot, _Slot *s):
        if s.holder >= 0:
            self._drop_waiter(s.holder)
            s.holder = -1

    cdef void _drop_waiter(self, int64_t waiter):
        entry = self._waiters.pop(waiter, None)
        if entry is not None:
            ws = self._owners.get(entry[2])
            if ws is not None:
                ws.discard(waiter)
                if not ws:
                    del self._owners[entry[2]]

    cdef list _advance(self, Py_ssize_t slot, double now):
        # Whatever moved now_serving, bring the slot to a resting state:
        # skip abandoned tickets, grant the parked waiter whose turn it is,
        # drop parked waiters whose ticket was passed (a client moved the
        # words by hand; they are told via ``lost``).  Each step pops what
        # it looks at, so the work is proportional to what moved.
        cdef _Slot *s = &self._s[slot]
        cdef uint64_t *w = self._words(slot)
        cdef uint64_t cur
        cdef int64_t cur_key
        parked = <object>self._parked[slot]
        gone = <set>self._abandoned[slot]
        heap = <list>self._abandoned_heap[slot]
        grants = []
        if s.holder >= 0:
            entry = self._waiters.get(s.holder)
            if entry is None or entry[1] != w[1]:
                # the holder's ticket was passed by a one-sided op or expiry
                self._forget_holder(slot, s)
        while True:
            cur = w[1]
            while parked and (_tdiff(parked[0][0], cur) < 0 or not self._is_live(parked[0])):
                t, wid = parked.popleft()
                if self._is_live((t, wid)):
                    self._live[slot] -= 1
                    self._drop_waiter(wid)
                    self.lost.append((slot, wid))
            cur_key = _tdiff(cur, s.base)
            while heap and heap[0] < cur_key:
                gone.discard(<uint64_t>(s.base + <uint64_t><int64_t>heappop(heap)))
            if cur == w[0]:
                break
            if cur in gone:
                if smb2_cas64(&w[1], cur, cur + 1):
                    gone.discard(cur)
                    self.abandoned_skips += 1
                continue
            if parked and parked[0][0] == cur:
                t, wid = parked.popleft()
                self._live[slot] -= 1
                self._grant(slot, s, wid, now)
                grants.append(wid)
            break
        if w[1] != s.seen_serving:
            s.seen_serving = w[1]
            s.seen_heartbeat = w[2]
            s.last_change = now
        return grants


# Client side --------------------------------------------------------------

TICKET_IDLE = 0
TICKET_WAITING = 1
TICKET_HELD = 2

OBSERVE_GRANTED = 0
OBSERVE_WAIT = 1
OBSERVE_LAPSED = 2


cdef class TicketState:
    """One client's acquisition of one lock, for the polling path (RDMA
    READs of now_serving) and the renewal schedule of both paths.

    ``observe(serving, now)`` decides from one read of now_serving: granted,
    lapsed (the queue passed the ticket: its lease ran out while we slept),
    or wait ``delay`` seconds.  The delay is proportional to the distance
    ``d = ticket - serving``: ``(d - 1/2) / 2`` estimated hold times (the
    hold time is learnt from how fast now_serving moves), clamped to
    ``[min_delay, max_delay]``: a waiter far back reads rarely, the next in
    line often, and nobody sleeps through a lease."""

    cdef readonly int state
    cdef readonly uint64_t ticket
    cdef readonly double lease
    cdef readonly double min_delay, max_delay
    cdef readonly double est_hold       # seconds per ticket served (EWMA)
    cdef readonly double renew_at       # when the holder must next renew
    cdef readonly double acquired_at
    cdef uint64_t _last_serving     # now_serving at the last read
    cdef double _prev_t             # time of the last read
    cdef double _move_t             # estimated time of the last move seen
    cdef bint _have_last, _have_move
    cdef double _start_t            # when the ticket was drawn
    cdef int64_t _first_d           # its distance at the first read

    def __init__(self, double lease, double min_delay=20e-6, double max_delay=0.05,
                 double est_hold=50e-6):
        if not lease > 0 or min_delay < 0 or max_delay < min_delay:
            raise ValueError("need lease > 0 and 0 <= min_delay <= max_delay")
        self.lease = lease
        self.min_delay = min_delay
        # never sleep past a quarter lease: a waiter whose turn came must
        # notice (and start renewing) long before its lease runs out
        self.max_delay = max_delay if max_delay < lease / 4 else lease / 4
        if self.min_delay > self.max_delay:
            self.min_delay = self.max_delay
        self.est_hold = est_hold if est_hold > 0 else 50e-6
        self.state = TICKET_IDLE

    def start(self, uint64_t ticket, double now):
        """We drew ``ticket``."""
        if self.state != TICKET_IDLE:
            raise ValueError("already waiting or holding")
        self.ticket = ticket
        self.state = TICKET_WAITING
        self._have_last = False
        self._have_move = False
        self._start_t = now
        self._first_d = 0
        return None

    def distance(self, uint64_t serving):
        return _tdiff(self.ticket, serving)

    def observe(self, uint64_t serving, double now):
        """One read of now_serving: ``(OBSERVE_*, delay)``."""
        if self.state != TICKET_WAITING:
            raise ValueError("not waiting")
        cdef int64_t d = _tdiff(self.ticket, serving)
        cdef int64_t moved
        cdef double sample, delay, t_move
        if d == 0:
            # Our wait served _first_d tickets: an upper bound of sorts on the
            # hold time, and the only sample a short queue gives (a waiter
            # next in line sees one move, the grant, and moves are timed
            # between two).  Taken only downwards, so that an estimate
            # inflated under a long queue decays once the queue is short,
            # and never upwards, where a late look would feed on itself.
            if self._first_d > 0:
                sample = (now - self._start_t) / self._first_d
                if sample < self.est_hold:
                    self.est_hold = 0.5 * self.est_hold + 0.5 * sample
            self.granted(now)
            return OBSERVE_GRANTED, 0.0
        if d < 0:
            self.state = TICKET_IDLE
            return OBSERVE_LAPSED, 0.0
        if self._first_d == 0:
            self._first_d = d
        if self._have_last:
            moved = _tdiff(serving, self._last_serving)
            if moved > 0:
                # The move happened between the previous read and this one:
                # date it half-way, so that reading rarely (far back in the
                # queue) does not inflate the estimate by the read interval.
                # The first move seen only starts the clock.
                t_move = 0.5 * (self._prev_t + now)
                if self._have_move:
                    sample = (t_move - self._move_t) / moved
                    if sample > 0:
                        self.est_hold = 0.5 * self.est_hold + 0.5 * sample
                self._move_t = t_move
                self._have_move = True
                self._last_serving = serving
        else:
            self._have_last = True
            self._last_serving = serving
        self._prev_t = now
        # Sleep until about half-way to our expected turn, (d - 1/2) hold
        # times away: the next in line (d == 1) looks again after a quarter
        # of a hold.  Sleeping the whole expected time instead would make
        # each hand-off idle while the next in line sleeps; the observed
        # service interval would include that idle time, and the estimate
        # would feed on itself up to max_delay.  Waking half-way bounds the
        # idle time, so the estimate settles near the true hold time.
        delay = 0.5 * (d - 0.5) * self.est_hold
        if delay < self.min_delay:
            delay = self.min_delay
        elif delay > self.max_delay:
            delay = self.max_delay
        return OBSERVE_WAIT, delay

    def granted(self, double now):
        """The lock is ours (parked path: the server said so)."""
        self.state = TICKET_HELD
        self.acquired_at = now
        self.renew_at = now + self.lease / 3
        return self.renew_at

    def renewed(self, double now):
        """The heartbeat was bumped at ``now``: next renewal deadline."""
        if self.state != TICKET_HELD:
            raise ValueError("not holding")
        self.renew_at = now + self.lease / 3
        return self.renew_at

    def released(self):
        self.state = TICKET_IDLE
        return None


# --------------------------------------------------------------------------
# Futexes on shared words: the shm lock's waiters and notification waits sleep on them.
#
# A shm client maps the server's memfds MAP_SHARED, so the SHARED futex
# operations (not FUTEX_*_PRIVATE, whose key is this process's address
# space) meet every other process that maps the same page: the key is the
# page and the offset, whatever address each process maps it at.  A futex
# is a 32-bit word: a u64 word's low half is at its own address (x86 and
# aarch64 are little endian), and it changes whenever the u64 does for any
# change smaller than 2**32 (a ticket moves by one, a notification slot
# grows), so waiting on the low half is waiting on the word.
#
# futex_wait_u64 blocks with the GIL released: call it from a thread, never
# from an event loop's own.

cdef extern from *:
    """
    #include <errno.h>
    #include <linux/futex.h>
    #include <sys/syscall.h>
    #include <time.h>
    #include <unistd.h>
    #include <stdint.h>
    /* 0: woken (or spurious), 1: the word was not `expected` already,
       2: timed out, 3: interrupted by a signal; -errno on an error. */
    static int smb2_futex_wait32(uint32_t *addr, uint32_t expected, double timeout) {
        struct timespec ts, *tp = NULL;
        if (timeout >= 0) {
            ts.tv_sec = (time_t)timeout;
            ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
            if (ts.tv_nsec >= 1000000000L) { ts.tv_sec += 1; ts.tv_nsec -= 1000000000L; }
            tp = &ts;
        }
        long r = syscall(SYS_futex, addr, FUTEX_WAIT, expected, tp, NULL, 0);
        if (r == 0) return 0;
        if (errno == EAGAIN) return 1;
        if (errno == ETIMEDOUT) return 2;
        if (errno == EINTR) return 3;
        return -errno;
    }
    static long smb2_futex_wake32(uint32_t *addr, int n) {
        long r = syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
        return r < 0 ? -errno : r;
    }
    /* Sleep until the u64 ticket word at `p` reaches `ticket` (a signed
       distance >= 0), at most `timeout` s.  Each sleep is tagged with the
       ticket's bit (ticket mod 32, FUTEX_WAIT_BITSET), so a release that
       wakes only the next ticket's bit wakes the next waiter alone, not
       every waiter (a plain FUTEX_WAKE still wakes all).  A wake that finds
       the word short of the ticket sleeps again here, without waking the
       caller.

       With `spin` > 0 the waiter spins instead of sleeping while it is next
       in line, for at most `spin` s, and asks to be woken one ticket early
       (its bit and the previous ticket's): the release that makes it next
       in line wakes it, and it is on a CPU, spinning, when its own turn
       comes, so the hand-off after it costs no wake-up.  Only for waiters
       with a CPU to spin on: where every waiter shares one, the spinner
       only delays the holder it waits for.

       0: reached, 2: timed out, 3: a signal; -errno on error. */
    #if defined(__x86_64__) || defined(__i386__)
    #define SMB2_PAUSE() __builtin_ia32_pause()
    #elif defined(__aarch64__)
    #define SMB2_PAUSE() __asm__ __volatile__("yield")
    #else
    #define SMB2_PAUSE() ((void)0)
    #endif
    static inline double smb2_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    }
    static int smb2_futex_wait_ticket_spin(uint64_t *p, uint64_t ticket, double timeout,
                                           double spin) {
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        double t = (double)until.tv_nsec * 1e-9 + timeout;
        until.tv_sec += (time_t)t;
        until.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
        uint32_t own = 1u << (ticket & 31);
        uint32_t bits = spin > 0 ? own | (1u << ((ticket - 1) & 31)) : own;
        for (;;) {
            uint64_t v = __atomic_load_n(p, __ATOMIC_SEQ_CST);
            int64_t d = (int64_t)(ticket - v);
            if (d <= 0) return 0;
            if (d == 1 && spin > 0) {
                double end = smb2_now() + spin;
                unsigned n = 0;
                while ((int64_t)(ticket - __atomic_load_n(p, __ATOMIC_SEQ_CST)) > 0) {
                    SMB2_PAUSE();
                    if (!(++n & 63) && smb2_now() >= end) break;
                }
                spin = 0;
                bits = own;
                continue;
            }
            long r = syscall(SYS_futex, (uint32_t *)p, FUTEX_WAIT_BITSET, (uint32_t)v, &until, NULL, bits);
            if (r < 0) {
                if (errno == EAGAIN) continue;
                if (errno == ETIMEDOUT) return 2;
                if (errno == EINTR) return 3;
                return -errno;
            }
        }
    }
    static int smb2_futex_wait_ticket(uint64_t *p, uint64_t ticket, double timeout) {
        return smb2_futex_wait_ticket_spin(p, ticket, timeout, 0.0);
    }
    static long smb2_futex_wake_ticket(uint32_t *addr, uint64_t ticket) {
        long r = syscall(SYS_futex, addr, FUTEX_WAKE_BITSET, 0x7FFFFFFF, NULL, NULL,
                         1u << (ticket & 31));
        return r < 0 ? -errno : r;
    }
    """
    int smb2_futex_wait32(uint32_t *addr, uint32_t expected, double timeout) nogil
    long smb2_futex_wake32(uint32_t *addr, int n) nogil
    int smb2_futex_wait_ticket(uint64_t *p, uint64_t ticket, double timeout) nogil
    int smb2_futex_wait_ticket_spin(uint64_t *p, uint64_t ticket, double timeout, double spin) nogil
    long smb2_futex_wake_ticket(uint32_t *addr, uint64_t ticket) nogil

# A lock slot's fourth word (it was reserved): the number of acquires the
# server has parked on it, kept by server/locks.py.  A shm holder releases
# with its own atomic while it is 0, and through the server otherwise, so
# that a parked TCP waiter is granted at once (docs/design.md, "The lock").
LOCK_PARKED = 24

FUTEX_WOKEN = 0
FUTEX_CHANGED = 1
FUTEX_TIMED_OUT = 2
FUTEX_INTERRUPTED = 3


def futex_wait_u64(const uint8_t[::1] mem, Py_ssize_t offset, uint64_t expected, double timeout):
    """Sleep while the u64 word at ``offset`` of ``mem`` is ``expected``, at
    most ``timeout`` seconds (negative: no limit).  Returns FUTEX_CHANGED
    at once if it is not, else FUTEX_WOKEN (which may be spurious: look at
    the word again), FUTEX_TIMED_OUT or FUTEX_INTERRUPTED.  The GIL is
    released while it sleeps."""
    cdef uint64_t *p = _word_read(mem, offset)
    cdef int r
    if smb2_load64(p) != expected:
        return FUTEX_CHANGED
    with nogil:
        r = smb2_futex_wait32(<uint32_t *>p, <uint32_t>expected, timeout)
    if r < 0:
        raise OSError(-r, f"futex wait on the word at offset {offset} failed")
    return r


def futex_wait_ticket(uint8_t[::1] mem, Py_ssize_t offset, uint64_t ticket, double timeout):
    """Sleep until the u64 ticket word at ``offset`` reaches ``ticket``
    (or passes it), at most ``timeout`` seconds: FUTEX_WOKEN once it has,
    else FUTEX_TIMED_OUT or FUTEX_INTERRUPTED.  Only ``futex_wake_ticket``
    of this ticket, or a plain ``futex_wake``, ends the sleep.  The GIL is
    released while it sleeps."""
    cdef uint64_t *p = _word_at(mem, offset)
    cdef int r
    with nogil:
        r = smb2_futex_wait_ticket(p, ticket, timeout)
    if r < 0:
        raise OSError(-r, f"futex wait on the word at offset {offset} failed")
    return r


def futex_wake_ticket(uint8_t[::1] mem, Py_ssize_t offset, uint64_t ticket):
    """Wake the ``futex_wait_ticket`` sleepers for ``ticket`` on the word
    (and any whose ticket is equal mod 32, who sleep again); the number woken."""
    cdef uint64_t *p = _word_at(mem, offset)
    cdef long r = smb2_futex_wake_ticket(<uint32_t *>p, ticket)
    if r < 0:
        raise OSError(-r, f"futex wake on the word at offset {offset} failed")
    return r


def futex_wake(uint8_t[::1] mem, Py_ssize_t offset, int n=0x7FFFFFFF):
    """Wake up to ``n`` (default: all) sleepers on the u64 word at
    ``offset``; the number woken.  Costs one system call (about a
    microsecond when nobody sleeps there)."""
    cdef uint64_t *p = _word_at(mem, offset)
    cdef long r = smb2_futex_wake32(<uint32_t *>p, n)
    if r < 0:
        raise OSError(-r, f"futex wake on the word at offset {offset} failed")
    return r


# A shm client's ticket records (fair tickets over shm): a shm waiter draws its ticket
# with its own atomic, so the server cannot tell whose it is.  Each shm
# connection therefore gets record words in the lock segment (a slot taken
# off the free list, server/locks.py) and stores there, with one plain
# atomic store, the (slot, ticket) it waits for or holds, and 0 once it has
# released.  When the connection dies the server reads them and passes the
# tickets on at once, as it does for the tickets of a parked connection.
# A record keeps the ticket's low 43 bits: the server has the rest from the
# slot's words, since fewer than 2**43 tickets are ever outstanding.
LOCK_RECORDS = 4            # record words per record slot
cdef uint64_t _REC_LOW = (1ULL << 43) - 1


def ticket_record(uint64_t slot, uint64_t ticket):
    """The record word of ``ticket`` of lock slot ``slot`` (never 0)."""
    if slot >= (1ULL << 20):
        raise ValueError(f"lock slot {slot} does not fit a ticket record")
    return (1ULL << 63) | (slot << 43) | (ticket & _REC_LOW)


def recorded_ticket(uint64_t record, uint64_t next_ticket, uint64_t now_serving):
    """The ticket a record word names, given the words of its slot
    (``record_slot(record)``), or None if that ticket was passed already."""
    cdef uint64_t d = ((record & _REC_LOW) - now_serving) & _REC_LOW
    if d >= next_ticket - now_serving:
        return None
    return now_serving + d


def record_slot(uint64_t record):
    """The lock slot a record word names, or -1 for an empty word."""
    if not record >> 63:
        return -1
    return <Py_ssize_t>((record >> 43) & ((1ULL << 20) - 1))


# --------------------------------------------------------------------------
# The futex path's atomics on one lock slot, one call each (why: below).
#
# Over shm an uncontended acquire + release is six word operations (draw,
# record, look, look at LOCK_PARKED, release, look again) and a wake; as
# awaited transport calls they cost ~28 us, fourteen times a TCP-free
# hand-off's worth.  Here they are plain C on the mapped words, and the
# waiter can sleep on the futex in the caller's thread (lock.py decides
# when the event loop may be blocked so).

RELEASE_DONE = 0            # released; nothing parked at the server
RELEASE_BY_SERVER = 1       # TCP waiters are parked: release through the server
RELEASE_LOST = 2            # now_serving had left our ticket: the lock was lost
RELEASE_PARKED_AFTER = 3    # released, but the server parked one meanwhile


cdef class MappedLock:
    """The words of one lock slot on a shm client's mapping of its server's
    lock segment: ``mapping`` (the whole mapped segment), the slot at byte
    ``offset``.  ``owner`` is the transport's LiveFlag: every method first
    checks it and raises ConnectionError once the server's connection is
    gone (the caller then takes the general path, which says so in the
    user's words).  The mapping is kept referenced, so its pages stay
    mapped while this object lives."""

    cdef uint64_t *words
    cdef uint64_t *record
    cdef readonly uint64_t recorded     # the value last stored in the record word
    cdef readonly uint64_t slot         # the slot's index (offset / 32)
    cdef object view
    cdef LiveFlag owner
    cdef public double spin             # seconds to spin while next in line (see above)

    def __cinit__(self, object mapping, Py_ssize_t offset, LiveFlag owner):
        cdef uint8_t[::1] whole = mapping
        if offset < 0 or offset % LOCK_SLOT_SIZE or offset + LOCK_SLOT_SIZE > whole.shape[0]:
            raise ValueError(f"no lock slot at offset {offset} of {whole.shape[0]} bytes")
        self.words = <uint64_t *>&whole[offset]
        if <size_t>self.words % 8:
            raise ValueError("the lock segment is not 8-byte aligned")
        self.record = NULL
        self.recorded = 0
        self.slot = offset // LOCK_SLOT_SIZE
        self.view = mapping
        self.owner = owner

    cdef int _check(self) except -1:
        if not self.owner.live:
            raise ConnectionError("the connection to the lock's server is gone")
        return 0

    def use_record(self, Py_ssize_t offset, uint64_t recorded):
        """Store each drawn ticket in the record word at ``offset`` of the
        same segment (whose value is ``recorded`` now); -1: none."""
        cdef uint8_t[::1] whole = self.view
        if offset < 0:
            self.record = NULL
            return
        if offset % 8 or offset + 8 > whole.shape[0]:
            raise ValueError(f"no record word at offset {offset}")
        if self.slot >= (1ULL << 20):
            raise ValueError(f"lock slot {self.slot} does not fit a ticket record")
        self.record = <uint64_t *>&whole[offset]
        self.recorded = recorded

    def draw(self):
        """Draw a ticket (and record it); returns ``(ticket, now_serving)``."""
        self._check()
        cdef uint64_t t = self._draw()
        return t, smb2_load64(&self.words[1])

    @property
    def live(self):
        """False once the server's connection is gone."""
        return self.owner.live

    def take(self, TicketState st, double block):
        """Draw a ticket into ``st`` (idle) and see whether it is served,
        sleeping on the futex in this thread, without the GIL, for at most
        ``block`` seconds if it is not yet.  ``st.observe``'s code:
        OBSERVE_GRANTED (``st`` holds the lock), OBSERVE_WAIT (it waits on
        for its ticket) or OBSERVE_LAPSED (the ticket was passed: draw
        again)."""
        self._check()
        cdef uint64_t t = self._draw()
        cdef uint64_t serving = smb2_load64(&self.words[1])
        cdef int r
        st.start(t, _monotonic())
        if serving != t and block > 0:
            with nogil:
                r = smb2_futex_wait_ticket_spin(&self.words[1], t, block, self.spin)
            if r < 0:
                raise OSError(-r, "futex wait on a lock's now_serving failed")
            serving = smb2_load64(&self.words[1])
        return st.observe(serving, _monotonic())[0]

    cdef uint64_t _draw(self) noexcept:
        cdef uint64_t t = smb2_fetch_add64(&self.words[0], 1)
        cdef uint64_t new
        if self.record != NULL:
            # the word is ours alone while we live (the server only reads it)
            self.recorded = (1ULL << 63) | (self.slot << 43) | (t & _REC_LOW)
            smb2_store64(self.record, self.recorded)
        return t

    def serving(self):
        """now_serving."""
        self._check()
        return smb2_load64(&self.words[1])

    def next_ticket(self):
        """next_ticket."""
        self._check()
        return smb2_load64(&self.words[0])

    def wait(self, uint64_t ticket, double timeout):
        """Sleep on the futex until now_serving reaches ``ticket``, at most
        ``timeout`` s, without the GIL; returns now_serving.  Blocks the
        calling thread: lock.py calls it on the loop's thread only within
        a budget, and from a helper thread otherwise."""
        self._check()
        cdef int r
        with nogil:
            r = smb2_futex_wait_ticket_spin(&self.words[1], ticket, timeout, self.spin)
        if r < 0:
            raise OSError(-r, "futex wait on a lock's now_serving failed")
        return smb2_load64(&self.words[1])

    def release(self, uint64_t ticket):
        """Pass the lock from ``ticket`` to the next ticket and wake that
        ticket's sleeper: RELEASE_DONE, RELEASE_PARKED_AFTER (the server
        parked a TCP acquire meanwhile: tell it to look again),
        RELEASE_LOST (now_serving was not ours: nothing changed), or
        RELEASE_BY_SERVER (TCP waiters are parked: nothing changed, the
        server must release so that it grants the next at once)."""
        self._check()
        if smb2_load64(&self.words[3]):
            return RELEASE_BY_SERVER
        if not smb2_cas64(&self.words[1], ticket, ticket + 1):
            return RELEASE_LOST
        smb2_futex_wake_ticket(<uint32_t *>&self.words[1], ticket + 1)
        # the server raises LOCK_PARKED before it looks at now_serving to
        # park an acquire, both seq-cst: either it saw the release, or we
        # see its mark now
        if smb2_load64(&self.words[3]):
            return RELEASE_PARKED_AFTER
        return RELEASE_DONE
