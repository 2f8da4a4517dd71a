/* smb2._core's pool of threads (pool.pxi says why there is one).  Its state
   is static: _core.c is the one file that includes this, so a process has
   one pool. */
#ifndef SMB2_POOL_H
#define SMB2_POOL_H

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
static inline void smb2_pool_take(void) {
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

static inline void *smb2_pool_worker(void *arg) {
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
static inline void smb2_pool_prepare(void) { pthread_mutex_lock(&smb2_pool_busy); pthread_mutex_lock(&smb2_pool_mu); }
static inline void smb2_pool_parent(void) { pthread_mutex_unlock(&smb2_pool_mu); pthread_mutex_unlock(&smb2_pool_busy); }
static inline void smb2_pool_child(void) {
    smb2_pool_workers = 0;
    pthread_mutex_init(&smb2_pool_mu, NULL);
    pthread_mutex_init(&smb2_pool_busy, NULL);
    pthread_cond_init(&smb2_pool_go, NULL);
    pthread_cond_init(&smb2_pool_done, NULL);
}

/* run jobs[0..k) (each job_size bytes) with fn, on this thread and up to
   k - 1 workers; returns when all have ended */
static inline void smb2_run_jobs(void *jobs, size_t job_size, int k, smb2_job_fn fn) {
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

#endif /* SMB2_POOL_H */
