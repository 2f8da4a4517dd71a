/* smb2._core's futex waits and wakes on shared words (futex.pxi). */
#ifndef SMB2_FUTEX_H
#define SMB2_FUTEX_H

#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <stdint.h>
/* 0: woken (or spurious), 1: the word was not `expected` already,
   2: timed out, 3: interrupted by a signal; -errno on an error. */
static inline int smb2_futex_wait32(uint32_t *addr, uint32_t expected, double timeout) {
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
static inline long smb2_futex_wake32(uint32_t *addr, int n) {
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
static inline int smb2_futex_wait_ticket_spin(uint64_t *p, uint64_t ticket, double timeout,
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
static inline int smb2_futex_wait_ticket(uint64_t *p, uint64_t ticket, double timeout) {
    return smb2_futex_wait_ticket_spin(p, ticket, timeout, 0.0);
}
static inline long smb2_futex_wake_ticket(uint32_t *addr, uint64_t ticket) {
    long r = syscall(SYS_futex, addr, FUTEX_WAKE_BITSET, 0x7FFFFFFF, NULL, NULL,
                     1u << (ticket & 31));
    return r < 0 ? -errno : r;
}

#endif /* SMB2_FUTEX_H */
