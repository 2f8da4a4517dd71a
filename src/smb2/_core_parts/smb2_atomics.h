/* smb2._core's seq-cst atomics on shared u64 words (atomics.pxi). */
#ifndef SMB2_ATOMICS_H
#define SMB2_ATOMICS_H

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

static inline uint64_t smb2_load64(uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static inline void smb2_store64(uint64_t *p, uint64_t v) {
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static inline uint64_t smb2_cas64_old(uint64_t *p, uint64_t expected, uint64_t desired) {
    __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected; /* the old value, whether or not it was replaced */ }

/* A load ordered after every store before it, streamed ones included
   (a full fence: on x86 a seq-cst load alone may pass earlier stores). */
static inline uint64_t smb2_load64_after_stores(uint64_t *p) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n(p, __ATOMIC_SEQ_CST); }

#endif /* SMB2_ATOMICS_H */
