# Part of smb2._core, included by _core.pyx (which lists the parts): futexes
# on shared words.

from libc.stdint cimport uint8_t, uint32_t, uint64_t

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

cdef extern from "smb2_futex.h":
    int smb2_futex_wait32(uint32_t *addr, uint32_t expected, double timeout) nogil
    long smb2_futex_wake32(uint32_t *addr, int n) nogil
    int smb2_futex_wait_ticket(uint64_t *p, uint64_t ticket, double timeout) nogil
    int smb2_futex_wait_ticket_spin(uint64_t *p, uint64_t ticket, double timeout, double spin) nogil
    long smb2_futex_wake_ticket(uint32_t *addr, uint64_t ticket) nogil

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
