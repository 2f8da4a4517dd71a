# Part of smb2._core, included by _core.pyx (which lists the parts): the pool
# of threads that large accumulates and copies are cut among.

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
cdef extern from "smb2_pool.h":
    void smb2_run_jobs(void *jobs, size_t job_size, int k, void *(*fn)(void *) noexcept nogil) nogil

cdef enum:
    # the most threads one call cuts its work among (--threads above it
    # is taken as this many)
    _MAX_THREADS = 64
MAX_THREADS = _MAX_THREADS


cdef inline void _run_jobs(void *jobs, size_t job_size, int k,
                           void *(*run)(void *) noexcept nogil) noexcept nogil:
    # The one way work is cut among threads here (a large copy on a
    # mapping, a large accumulate): the jobs run on this thread and the
    # pool's workers (above), and all have ended when it returns, so the
    # caller sees the work done as if by one call.
    smb2_run_jobs(jobs, job_size, k, run)
