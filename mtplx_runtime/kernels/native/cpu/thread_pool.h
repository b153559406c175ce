/* The CPU expert library's persistent thread pool: one per process, shared by every codec. */
#ifndef MTPLX_THREAD_POOL_H
#define MTPLX_THREAD_POOL_H

#define MAX_THREADS 256 /* most chunks one region may have */

typedef void (*chunk_fn)(void *arg, int chunk);

/* Run fn(arg, c) for c in 0..n-1 (n <= MAX_THREADS) and return when every chunk has finished:
 * the caller runs chunk 0, worker i chunk i (workers are started on demand). Regions are
 * serialized, so concurrent callers queue; a forked child starts from an empty pool. */
void run_chunks(chunk_fn fn, void *arg, int n);

#endif
