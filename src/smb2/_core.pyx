# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Sans-IO hot paths of smb2: no asyncio, no sockets, no verbs.

One extension module built from the parts in ``_core_parts/``, one concern
each, included below (their C is in the ``smb2_*.h`` headers beside them):

* ``codec.pxi``: the fixed 32-byte frame header and the u64 payload words
  (encode/decode; ``smb2_codec.h``),
* ``planner.pxi``: the buffer-name hash that picks a buffer's first server,
  and the stripe planner (which server holds which byte of a buffer),
* ``pool.pxi``: the process's pool of threads, among which a large
  accumulate or copy is cut (``smb2_pool.h``),
* ``kernels.pxi``: the accumulate kernels (``dst += src`` elementwise, dense
  and sparse, GIL released), the bfloat16 and float16 conversions
  (``smb2_half.h``) and ``copy_into``,
* ``atomics.pxi``: seq-cst atomics on the u64 words of shared memory
  (``smb2_atomics.h``),
* ``mapped_stripes.pxi``: ``MappedStripes``, the same-host fast path, which
  does a whole read, write or atomic on the segments shm transports mapped
  (``smb2_stream.h``: copies that bypass the cache),
* ``lock.pxi``: the FIFO ticket lock's words and state machines,
  ``LockTable`` (a server's slots) and ``TicketState`` (one acquisition),
* ``futex.pxi``: futex waits and wakes on shared words (``smb2_futex.h``),
* ``mapped_lock.pxi``: ``MappedLock``, a shm client's lock on its mapping of
  the lock segment, and the ticket records its server reads.

The parts make one module: each sees every other's names.  The pure
functions (codec, planner, kernels) are tested against plain-Python
references with hypothesis (tests/test_core.py).
"""

include "_core_parts/codec.pxi"
include "_core_parts/planner.pxi"
include "_core_parts/pool.pxi"
include "_core_parts/kernels.pxi"
include "_core_parts/atomics.pxi"
include "_core_parts/mapped_stripes.pxi"
include "_core_parts/lock.pxi"
include "_core_parts/futex.pxi"
include "_core_parts/mapped_lock.pxi"
