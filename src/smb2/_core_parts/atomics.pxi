# Part of smb2._core, included by _core.pyx (which lists the parts): atomics
# on the u64 words of shared memory.

from libc.stdint cimport uint8_t, uint64_t

cdef extern from "smb2_atomics.h":
    uint64_t smb2_fetch_add64(uint64_t *p, uint64_t v) nogil
    bint smb2_cas64(uint64_t *p, uint64_t expected, uint64_t desired) nogil
    uint64_t smb2_load64(uint64_t *p) nogil
    void smb2_store64(uint64_t *p, uint64_t v) nogil
    uint64_t smb2_cas64_old(uint64_t *p, uint64_t expected, uint64_t desired) nogil
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
