/* The CPU expert library's persistent thread pool: one per process, shared by every codec. */
#ifndef MTPLX_THREAD_POOL_H
#define MTPLX_THREAD_POOL_H

#define MAX_THREADS 256 /* most threads one region may have */

typedef void (*chunk_fn)(void *arg, int chunk);

/* Run fn(arg, c) for c in 0..chunks-1 on up to `threads` threads (threads <= MAX_THREADS) and
 * return when every chunk has finished: the caller and threads - 1 workers (started on demand)
 * each claim the next unclaimed chunk until none is left, so a thread the OS preempts holds up
 * only the chunk it is in. Regions are serialized, so concurrent callers queue; a forked child
 * starts from an empty pool. */
void run_chunks(chunk_fn fn, void *arg, int chunks, int threads);

#endif
