# Part of smb2._core, included by _core.pyx (which lists the parts):
# MappedStripes, the same-host fast path.

from libc.stdint cimport uint8_t, uint64_t, int64_t
from libc.string cimport memcpy
from libc.stdlib cimport calloc, free
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE,
                             PyBUF_C_CONTIGUOUS)
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong

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

cdef extern from "smb2_stream.h":
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
