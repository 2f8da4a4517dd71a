# Part of smb2._core, included by _core.pyx (which lists the parts):
# MappedLock, the shm client's lock on its mapping, and its ticket records.

from libc.stdint cimport uint8_t, uint32_t, uint64_t

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
