/* The persistent thread pool (thread_pool.h).
 * A region runs fn(arg, chunk) for chunk 0..chunks-1 on the caller and workers 1..threads-1,
 * each claiming chunks from an atomic counter: with several chunks per thread, a thread that
 * loses its CPU for a while (a read landing, another process) leaves its later chunks to the
 * others instead of stalling the region (benchmarks log, "Threads that claim chunks"). Regions
 * are serialized by `call_mu`, so concurrent callers (ctypes drops the GIL) simply queue. A
 * decode step makes dozens of short regions back to back, so the hand-off latency matters: both
 * sides first spin on an atomic for up to POOL_SPIN_NS and only then block on the condition
 * variable, so back-to-back regions hand off in well under a microsecond and an idle pool still
 * sleeps (why not condition variables alone, and why no sched_yield in the spin: benchmarks log,
 * "CPU kernel notes"). Spinning only pays when every thread has a CPU of its own, so regions
 * with more threads than the CPUs this process may run on block at once; and only the workers
 * that took part in the last region spin after it (idle spinners would crowd the workers that
 * have work).
 *
 * Hand-off: `ticket` packs (generation << 32 | spin flag << 31 | threads run) in one atomic
 * word, published with release after fn/arg/chunks and the reset claim counter are written, so a
 * worker that reads a new generation with acquire also sees that region's thread count and spin
 * flag, and fn/arg/chunks when its id is in range. A worker that takes no part only reads the
 * ticket; one that takes part is waited for (even if it finds every chunk claimed), so
 * fn/arg/chunks and the counter cannot change under it. Sleepers are counted under `mu` (worker:
 * sleepers++, then re-check the ticket, then wait; caller: publish the ticket under `mu`,
 * broadcast if any sleep), and the caller's own wait is the same pattern with `caller_waits`,
 * so no wake-up is lost. */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity / CPU_COUNT (the pool's spin decision) */
#endif
#include "thread_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

/* Spin window: longer than the Python between two experts' calls in a decode step (0.2-0.4 ms;
 * a worker that blocks costs ~1 ms to wake on a VM), short next to the step itself. */
#define POOL_SPIN_NS 1000000
#define TICKET_SPIN (1u << 31) /* the region's threads fit on the CPUs: its workers may spin */
#define TICKET_THREADS(t) ((int)((uint32_t)(t) & ~TICKET_SPIN))
#define TICKET_GEN(t) ((uint32_t)((t) >> 32))

static struct {
    pthread_mutex_t call_mu, mu;
    pthread_cond_t go, done;
    int workers;             /* threads started so far (ids 1..workers) */
    _Atomic uint64_t ticket; /* generation << 32 | TICKET_SPIN | threads run this region */
    atomic_int pending;      /* workers taking part in this region, not yet finished */
    atomic_int next;         /* the next unclaimed chunk of this region */
    int chunks;              /* chunks of this region */
    int sleepers;            /* workers blocked on `go` (under mu) */
    int caller_waits;        /* the caller is blocked on `done` (under mu) */
    int cpus;                /* CPUs this process may run on (at pool start / after fork) */
    chunk_fn fn;
    void *arg;
    uint64_t start_ticket[MAX_THREADS]; /* the ticket current when worker i was created */
} pool = {.call_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
          .go = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static int pool_cpus(void) {
    cpu_set_t set;
    int n = sched_getaffinity(0, sizeof set, &set) ? 0 : CPU_COUNT(&set);
    return n > 0 ? n : 1;
}

/* A forked child has none of the parent's workers: start from an empty pool (the generation is
 * kept; new workers start from the current one). */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.call_mu, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.go, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0;
    pool.sleepers = 0;
    pool.caller_waits = 0;
    atomic_store(&pool.pending, 0);
    pool.cpus = pool_cpus(); /* the child may have been given other CPUs */
}

static void pool_init(void) {
    pool.cpus = pool_cpus();
    pthread_atfork(NULL, NULL, pool_after_fork);
}

static inline uint64_t pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO, read once per 16 pauses */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One step of a bounded spin (i counts from 0): 0 once POOL_SPIN_NS have passed since i = 0. */
static inline int pool_spin_step(unsigned i, uint64_t *t0) {
    if (i % 16 == 0) { /* the clock every 16 pauses */
        uint64_t now = pool_now_ns();
        if (i == 0) *t0 = now;
        else if (now - *t0 > POOL_SPIN_NS) return 0;
    }
    _mm_pause();
    return 1;
}

/* Claim and run chunks of the current region until none is left. */
static void pool_claim_chunks(void) {
    int c;
    while ((c = atomic_fetch_add_explicit(&pool.next, 1, memory_order_relaxed)) < pool.chunks)
        pool.fn(pool.arg, c);
}

/* Worker `id`, last region `last`: spin until the ticket's generation changes (returns the new
 * ticket) or the window passes (returns `last`: block). No spin unless it took part in `last`
 * and `last` allowed spinning. */
static uint64_t pool_spin_ticket(int id, uint64_t last) {
    if (!(last & TICKET_SPIN) || id >= TICKET_THREADS(last)) return last;
    uint64_t t0 = 0;
    for (unsigned i = 0; pool_spin_step(i, &t0); i++) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if (TICKET_GEN(t) != TICKET_GEN(last)) return t;
    }
    return last;
}

static void *pool_worker(void *p) {
    int id = (int)(intptr_t)p;
    uint64_t last = pool.start_ticket[id]; /* a region it took no part in: it blocks first */
    for (;;) {
        uint64_t t = pool_spin_ticket(id, last);
        if (TICKET_GEN(t) == TICKET_GEN(last)) { /* idle for a while: block */
            pthread_mutex_lock(&pool.mu);
            pool.sleepers++;
            while (TICKET_GEN(t = atomic_load_explicit(&pool.ticket, memory_order_acquire)) ==
                   TICKET_GEN(last))
                pthread_cond_wait(&pool.go, &pool.mu);
            pool.sleepers--;
            pthread_mutex_unlock(&pool.mu);
        }
        last = t;
        if (id >= TICKET_THREADS(t)) continue; /* this worker takes no part in this region */
        pool_claim_chunks();
        if (atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool.mu); /* last one: wake the caller if it went to sleep */
            if (pool.caller_waits) pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

void run_chunks(chunk_fn fn, void *arg, int chunks, int threads) {
    int n = threads < chunks ? threads : chunks; /* threads taking part */
    if (n <= 1) {
        for (int c = 0; c < chunks; c++) fn(arg, c);
        return;
    }
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool.call_mu);
    pthread_mutex_lock(&pool.mu);
    uint64_t cur = atomic_load_explicit(&pool.ticket, memory_order_relaxed);
    while (pool.workers < n - 1) { /* grow on demand; a failed create leaves the chunk to us */
        int id = pool.workers + 1;
        pthread_t tid;
        pool.start_ticket[id] = cur;
        if (pthread_create(&tid, NULL, pool_worker, (void *)(intptr_t)id)) break;
        pthread_detach(tid);
        pool.workers = id;
    }
    int handed = n - 1 < pool.workers ? n - 1 : pool.workers;
    int spin = n <= pool.cpus;
    pool.fn = fn, pool.arg = arg, pool.chunks = chunks;
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.pending, handed, memory_order_relaxed);
    atomic_store_explicit(&pool.ticket,
                          (uint64_t)(TICKET_GEN(cur) + 1) << 32 | (spin ? TICKET_SPIN : 0) |
                              (uint32_t)(handed + 1),
                          memory_order_release);
    if (pool.sleepers) pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    pool_claim_chunks();
    /* wait for the workers: spin first (they usually finish within microseconds of us) */
    uint64_t t0 = 0;
    for (unsigned i = 0; spin && atomic_load_explicit(&pool.pending, memory_order_acquire); i++)
        if (!pool_spin_step(i, &t0)) break;
    if (atomic_load_explicit(&pool.pending, memory_order_acquire)) {
        pthread_mutex_lock(&pool.mu);
        pool.caller_waits = 1;
        while (atomic_load_explicit(&pool.pending, memory_order_acquire))
            pthread_cond_wait(&pool.done, &pool.mu);
        pool.caller_waits = 0;
        pthread_mutex_unlock(&pool.mu);
    }
    pthread_mutex_unlock(&pool.call_mu);
}
