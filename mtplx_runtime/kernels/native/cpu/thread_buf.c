/* Per-thread buffers that persist across calls (cpu_common.h thread_floats): a row kernel that
 * needs more than the driver's scratch (t158's input tables, nib_split.h's reordered inputs) keeps
 * one per thread instead of allocating per call (per call, a large buffer would be an mmap plus
 * page faults). Freed at thread exit. */
#include <pthread.h>

#include "cpu_common.h"

typedef struct {
    float *p[THREAD_BUF_SLOTS];
    size_t cap[THREAD_BUF_SLOTS]; /* floats */
} thread_bufs;

static pthread_key_t key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;

static void bufs_free(void *v) {
    thread_bufs *b = v;
    for (int i = 0; i < THREAD_BUF_SLOTS; i++) free(b->p[i]);
    free(b);
}

static void key_init(void) { pthread_key_create(&key, bufs_free); }

float *thread_floats(int slot, size_t floats) {
    pthread_once(&key_once, key_init);
    thread_bufs *b = pthread_getspecific(key);
    if (!b) {
        if (!(b = calloc(1, sizeof *b))) return NULL;
        if (pthread_setspecific(key, b)) {
            free(b);
            return NULL;
        }
    }
    if (b->cap[slot] < floats) {
        free(b->p[slot]);
        b->cap[slot] = 0;
        if (!(b->p[slot] = aligned_alloc(64, (floats * 4 + 63) / 64 * 64))) return NULL;
        b->cap[slot] = floats;
    }
    return b->p[slot];
}
