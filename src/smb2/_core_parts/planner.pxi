# Part of smb2._core, included by _core.pyx (which lists the parts): where a
# buffer's bytes live: its name's hash, the stripe planner.

from cpython.bytes cimport PyBytes_AS_STRING
from libc.stdint cimport uint64_t, int64_t
from cpython.array cimport array

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
