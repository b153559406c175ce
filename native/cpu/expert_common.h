/* Shared driver of the CPU expert kernels: thread pool, ISA choice, bf16 rounding, SiTU-GLU and
 * the multi-token GEMM / expert-MLP pipeline. Each codec source (t158_cpu.c, mxfp4_cpu.c,
 * ctint_cpu.c) includes this header once and defines the two hooks declared below; everything
 * else, including the exported C ABI, lives here so every codec shares one behaviour.
 *
 * Exported ABI (same names in every codec library; ctypes loads each library RTLD_LOCAL):
 *   int mtplx_cpu_gemm(packed, scale, zero, rows, cols, bits, layout, X, n, Y, threads)
 *       Y[n, rows] = X[n, cols] · Wᵀ, W one codec matrix.
 *   int mtplx_cpu_expert(mats[9], R, I, bits, layout, X, n, out, beta, beta_lin, round_model,
 *                        threads)
 *       out[n, R] = down · SiTU-GLU(gate·x_t, up·x_t) for every token row x_t of X[n, R];
 *       mats = {gate packed, scale, zero, up packed, scale, zero, down packed, scale, zero}.
 *   int mtplx_cpu_best_isa(void), mtplx_cpu_get_isa(void), mtplx_cpu_set_isa(int want)
 *       0 scalar, 1 avx2, 2 avx512 (the best the CPU supports unless lowered).
 * Return codes: 0 ok, -1 bad shape or parameter, -2 out of memory, -3 invalid scale byte.
 *
 * Numerics: every dot product accumulates in fp32. The weights a kernel multiplies are the
 * exact values the NumPy codec decodes, so only the fp32 summation order differs from "decode,
 * then matmul". Per token the arithmetic does not depend on n, the thread count or the row
 * chunking, so an n-token call equals n one-token calls bit for bit. round_model = 1 mirrors a
 * bf16 model (model/layers.py glu_mlp): gate·x and up·x rounded to bf16, SiTU-GLU in fp32 then
 * rounded, down·h rounded; round_model = 0 is an fp32 model (nothing rounded).
 */
#ifndef MTPLX_EXPERT_COMMON_H
#define MTPLX_EXPERT_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity / CPU_COUNT (the pool's spin decision) */
#endif
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64       /* columns per decode block: every codec's group size divides it */
#define XPAD 16        /* zero floats after each input row: t158's SIMD paths read 8 past it */
#define MAX_THREADS 256

/* One quantized matrix [rows, cols] as the codec stores it (pointers into record bytes). */
typedef struct {
    const uint8_t *packed, *scale, *zero; /* zero: ct-int-asym zero points, else NULL */
    int rows, cols, bits, layout;         /* bits, layout: ct-int only (layout 1 = legacy 3-bit) */
    size_t row_bytes, scale_row_bytes;    /* filled in by codec_prepare */
} mat_t;

/* Y[t*ldy + r] = row r of m · X[t*ldx ...] for t < n, r in [r0, r1). `scratch` holds
 * scratch_floats(m->cols) floats, 64-byte aligned, private to the calling thread. */
typedef void (*rows_fn)(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                        int r0, int r1, float *scratch);
/* The exact decoded weights of columns [64b, 64b + 64) of row r into w (64-byte aligned). */
typedef void (*decode_fn)(const mat_t *m, int r, int b, float *w);

/* Hooks each codec source defines. codec_prepare checks bits/layout/shape and fills the row
 * strides (0, or a negative return code); codec_rows picks the row kernel for an ISA. */
static int codec_prepare(mat_t *m);
static rows_fn codec_rows(const mat_t *m, int isa);

/* ---- small numeric helpers ---- */

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bf16f(uint16_t u) { return bits_f32((uint32_t)u << 16); }

/* fp32 -> nearest-even bf16 -> fp32, the formula of formats/base.py f32_to_bf16_bits (no NaN
 * case): used where the codec itself rounds (ct-int dequant), so the weights match bit for bit. */
static inline float rne_bf16_codec(float f) {
    uint32_t u = f32_bits(f);
    return bits_f32((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

/* What torch's float -> bfloat16 cast does (nearest even, NaN kept NaN): model rounding. */
static inline float round_bf16(float f) {
    if (f != f) return f;
    return rne_bf16_codec(f);
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4); /* record bytes carry no alignment promise */
    return v;
}

static inline uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* SiTU-GLU in fp32 with the reference's operation order (model/layers.py situ_glu). */
static inline float situ_glu(float g, float u, float beta, float beta_lin) {
    float sig = 1.0f / (1.0f + expf(-g));
    return beta * tanhf(g / beta) * sig * (beta_lin * tanhf(u / beta_lin));
}

/* ---- ISA selection: one portable build, variants behind per-function target attributes ---- */

static int g_isa = -1;

int mtplx_cpu_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* Select path min(want, best); want < 0 means best. Returns the path now in use. */
int mtplx_cpu_set_isa(int want) {
    int best = mtplx_cpu_best_isa();
    g_isa = (want < 0 || want > best) ? best : want;
    return g_isa;
}

int mtplx_cpu_get_isa(void) {
    if (g_isa < 0) mtplx_cpu_set_isa(-1);
    return g_isa;
}

/* ---- generic row kernels ----
 * A block of RB rows is decoded once into a float buffer (RB x cols, ~57 KB at K3: it stays in
 * L2), then every tile of up to TT tokens (4 on avx512, 2 on avx2) runs a register-tiled dot
 * over it: RB x TT accumulators, fed by RB weight loads and TT input loads per SIMD step, so n
 * tokens cost one decode and n/TT passes over the buffer. Every (row, token) result is one
 * accumulation chain over the columns in a fixed order whatever the tile shape, so it does not
 * depend on n, the tile a token falls in, or the rows around it (n tokens == n one-token calls,
 * bit for bit).
 * Rows past r1 in the last block decode as zeros and their results are dropped. */

#define RB 4 /* rows per decoded block */

/* Decode rows [r, r + rb) into w (RB rows of stride ldw; missing rows zero). */
static inline __attribute__((always_inline)) void
decode_rows(decode_fn dec, const mat_t *m, int r, int rb, float *w, int ldw) {
    for (int i = 0; i < RB; i++) {
        if (i >= rb) {
            memset(w + (size_t)i * ldw, 0, (size_t)m->cols * 4);
            continue;
        }
        for (int b = 0; b < m->cols / BLOCK; b++)
            dec(m, r + i, b, w + (size_t)i * ldw + (size_t)b * BLOCK);
    }
}

/* One decoded row block: the stride cols + 16 keeps the RB rows off a 4 KiB multiple so they
 * do not alias in L1. */
static inline int block_stride(int cols) { return cols + 16; }
static inline size_t scratch_floats(int cols) { return (size_t)RB * block_stride(cols); }

static inline __attribute__((always_inline)) void
rows_tpl_scalar(decode_fn dec, const mat_t *m, const float *X, int ldx, int n, float *Y,
                int ldy, int r0, int r1, float *w) {
    int ldw = block_stride(m->cols);
    for (int r = r0; r < r1; r += RB) {
        int rb = r1 - r < RB ? r1 - r : RB;
        decode_rows(dec, m, r, rb, w, ldw);
        for (int i = 0; i < rb; i++)
            for (int t = 0; t < n; t++) {
                const float *wi = w + (size_t)i * ldw, *x = X + (size_t)t * ldx;
                float s[4] = {0, 0, 0, 0};
                for (int k = 0; k < m->cols; k += 4)
                    for (int j = 0; j < 4; j++) s[j] += wi[k + j] * x[k + j];
                Y[(size_t)t * ldy + r + i] = (s[0] + s[1]) + (s[2] + s[3]);
            }
    }
}

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* RB rows x TT tokens (TT a constant at each call site, so acc stays in registers). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
tile_avx2(const float *w, int ldw, const float *X, int ldx, int TT, int cols, float *Y, int ldy,
          int rb) {
    __m256 acc[RB][2];
    for (int i = 0; i < RB; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int k = 0; k < cols; k += 8) {
        __m256 wv[RB];
        for (int i = 0; i < RB; i++) wv[i] = _mm256_load_ps(w + (size_t)i * ldw + k);
        for (int j = 0; j < TT; j++) {
            __m256 x = _mm256_load_ps(X + (size_t)j * ldx + k);
            for (int i = 0; i < RB; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], x, acc[i][j]);
        }
    }
    for (int i = 0; i < rb; i++)
        for (int j = 0; j < TT; j++) Y[(size_t)j * ldy + i] = hsum256(acc[i][j]);
}

/* Few tokens (n <= TT, decode above all): decode each 64-column block of the RB rows into an
 * L1-resident 1 KB buffer right before it is used, instead of a whole row block through L2.
 * The accumulation chains are those of tile_avx2 (same order over k), so results are too. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
fused_avx2(decode_fn dec, const mat_t *m, const float *X, int ldx, int TT, float *Y, int ldy,
           int r, int rb) {
    float wb[RB][BLOCK] __attribute__((aligned(64)));
    __m256 acc[RB][2];
    for (int i = 0; i < RB; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        for (int i = 0; i < RB; i++) {
            if (i < rb) dec(m, r + i, b, wb[i]);
            else memset(wb[i], 0, sizeof wb[i]);
        }
        for (int k = 0; k < BLOCK; k += 8) {
            __m256 wv[RB];
            for (int i = 0; i < RB; i++) wv[i] = _mm256_load_ps(wb[i] + k);
            for (int j = 0; j < TT; j++) {
                __m256 x = _mm256_load_ps(X + (size_t)j * ldx + (size_t)b * BLOCK + k);
                for (int i = 0; i < RB; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], x, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < rb; i++)
        for (int j = 0; j < TT; j++) Y[(size_t)j * ldy + r + i] = hsum256(acc[i][j]);
}

__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
rows_tpl_avx2(decode_fn dec, const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
              int r0, int r1, float *w) {
    int ldw = block_stride(m->cols);
    for (int r = r0; r < r1; r += RB) {
        int rb = r1 - r < RB ? r1 - r : RB;
        if (n <= 2) {
            if (n == 2) fused_avx2(dec, m, X, ldx, 2, Y, ldy, r, rb);
            else fused_avx2(dec, m, X, ldx, 1, Y, ldy, r, rb);
            continue;
        }
        decode_rows(dec, m, r, rb, w, ldw);
        int t = 0;
        for (; t + 2 <= n; t += 2)
            tile_avx2(w, ldw, X + (size_t)t * ldx, ldx, 2, m->cols, Y + (size_t)t * ldy + r, ldy,
                      rb);
        if (t < n)
            tile_avx2(w, ldw, X + (size_t)t * ldx, ldx, 1, m->cols, Y + (size_t)t * ldy + r, ldy,
                      rb);
    }
}

#define AVX512_TARGET "avx512f,avx512dq,avx512bw,avx2,fma"

__attribute__((target(AVX512_TARGET))) static inline float hsum512(__m512 v) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
tile_avx512(const float *w, int ldw, const float *X, int ldx, int TT, int cols, float *Y,
            int ldy, int rb) {
    __m512 acc[RB][4];
    for (int i = 0; i < RB; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    for (int k = 0; k < cols; k += 16) {
        __m512 wv[RB];
        for (int i = 0; i < RB; i++) wv[i] = _mm512_load_ps(w + (size_t)i * ldw + k);
        for (int j = 0; j < TT; j++) {
            __m512 x = _mm512_load_ps(X + (size_t)j * ldx + k);
            for (int i = 0; i < RB; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], x, acc[i][j]);
        }
    }
    for (int i = 0; i < rb; i++)
        for (int j = 0; j < TT; j++) Y[(size_t)j * ldy + i] = hsum512(acc[i][j]);
}

/* fused_avx2 for AVX-512 (chains of tile_avx512). */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
fused_avx512(decode_fn dec, const mat_t *m, const float *X, int ldx, int TT, float *Y, int ldy,
             int r, int rb) {
    float wb[RB][BLOCK] __attribute__((aligned(64)));
    __m512 acc[RB][4];
    for (int i = 0; i < RB; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        for (int i = 0; i < RB; i++) {
            if (i < rb) dec(m, r + i, b, wb[i]);
            else memset(wb[i], 0, sizeof wb[i]);
        }
        for (int k = 0; k < BLOCK; k += 16) {
            __m512 wv[RB];
            for (int i = 0; i < RB; i++) wv[i] = _mm512_load_ps(wb[i] + k);
            for (int j = 0; j < TT; j++) {
                __m512 x = _mm512_load_ps(X + (size_t)j * ldx + (size_t)b * BLOCK + k);
                for (int i = 0; i < RB; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], x, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < rb; i++)
        for (int j = 0; j < TT; j++) Y[(size_t)j * ldy + r + i] = hsum512(acc[i][j]);
}

__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
rows_tpl_avx512(decode_fn dec, const mat_t *m, const float *X, int ldx, int n, float *Y,
                int ldy, int r0, int r1, float *w) {
    int ldw = block_stride(m->cols);
    for (int r = r0; r < r1; r += RB) {
        int rb = r1 - r < RB ? r1 - r : RB;
        switch (n) { /* few tokens: decode block by block in L1 (constant-width tiles) */
        case 1: fused_avx512(dec, m, X, ldx, 1, Y, ldy, r, rb); continue;
        case 2: fused_avx512(dec, m, X, ldx, 2, Y, ldy, r, rb); continue;
        case 3: fused_avx512(dec, m, X, ldx, 3, Y, ldy, r, rb); continue;
        case 4: fused_avx512(dec, m, X, ldx, 4, Y, ldy, r, rb); continue;
        }
        decode_rows(dec, m, r, rb, w, ldw);
        int t = 0;
        for (; t + 4 <= n; t += 4)
            tile_avx512(w, ldw, X + (size_t)t * ldx, ldx, 4, m->cols, Y + (size_t)t * ldy + r,
                        ldy, rb);
        const float *x = X + (size_t)t * ldx;
        float *y = Y + (size_t)t * ldy + r;
        switch (n - t) { /* the remainder as one constant-width tile */
        case 3: tile_avx512(w, ldw, x, ldx, 3, m->cols, y, ldy, rb); break;
        case 2: tile_avx512(w, ldw, x, ldx, 2, m->cols, y, ldy, rb); break;
        case 1: tile_avx512(w, ldw, x, ldx, 1, m->cols, y, ldy, rb); break;
        }
    }
}

/* ---- persistent thread pool ----
 * A region runs fn(arg, chunk) for chunk 0..n-1; the caller runs chunk 0, worker i runs chunk
 * i. Regions are serialized by `call_mu`, so concurrent callers (ctypes drops the GIL) simply
 * queue. A T=1 expert is two regions of ~0.3 ms each, and a decode step makes dozens of them
 * back to back, so the hand-off latency matters: sleeping on condition variables alone cost
 * two futex wake-ups per region (worker start, caller resume), ~0.1 ms per K3 expert on the
 * 2-vCPU VM (0.88 vs the lab's 0.68 ms with a spinning pool). So both sides first spin on an
 * atomic for up to POOL_SPIN_NS and only then block on the condition variable: back-to-back
 * regions hand off in well under a microsecond, and an idle pool still sleeps (it never burns a
 * core for longer than POOL_SPIN_NS after its last region). Spinning only pays when every chunk
 * has a CPU of its own: with more chunks than the CPUs this process may run on, a spinning
 * thread holds a CPU that a thread with work needs (measured: 4 threads on 2 vCPUs went from
 * 0.9 to 1.6 ms per expert), so such regions block at once; and only the workers that ran a
 * chunk of the last region spin after it (after a 2-thread region following an 8-thread one,
 * six idle spinners would otherwise crowd the one worker that has work). The spin does not
 * sched_yield: tried every ~6 us, it cost bench_kernels' t158 T=1 layer ~1.5 ms (13.0 ->
 * 14.5 ms).
 *
 * Hand-off: `ticket` packs (generation << 32 | spin flag << 31 | chunks run) in one atomic word,
 * published with release after fn/arg are written, so a worker that reads a new generation with
 * acquire also sees that region's chunk count and spin flag, and fn/arg when its id is in range.
 * A worker that is not handed a chunk only reads the ticket; one that is handed a chunk is
 * waited for, so fn/arg cannot change under it. Sleepers are counted under `mu` (worker: sleepers++, then
 * re-check the ticket, then wait; caller: publish the ticket under `mu`, broadcast if any
 * sleep), and the caller's own wait is the same pattern with `caller_waits`, so no wake-up is
 * lost. */

#include <stdatomic.h>
#include <time.h>

/* Spin window: several times the gap between two experts' calls in the runtime (cpu.py's
 * per-expert Python work measured ~40 us), short next to the rest of a decode step. */
#define POOL_SPIN_NS 200000
#define TICKET_SPIN (1u << 31) /* the region's chunks fit on the CPUs: its workers may spin */
#define TICKET_CHUNKS(t) ((int)((uint32_t)(t) & ~TICKET_SPIN))
#define TICKET_GEN(t) ((uint32_t)((t) >> 32))

typedef void (*chunk_fn)(void *arg, int chunk);

static struct {
    pthread_mutex_t call_mu, mu;
    pthread_cond_t go, done;
    int workers;             /* threads started so far (ids 1..workers) */
    _Atomic uint64_t ticket; /* generation << 32 | TICKET_SPIN | chunks run this region */
    atomic_int pending;      /* chunks handed to workers this region, not yet finished */
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
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: ~30 ns, read once per 16 pauses */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One step of a bounded spin (i counts from 0): 0 once POOL_SPIN_NS have passed since i = 0. */
static inline int pool_spin_step(unsigned i, uint64_t *t0) {
    if (i % 16 == 0) { /* the clock every 16 pauses (~0.4 us on Zen 4) */
        uint64_t now = pool_now_ns();
        if (i == 0) *t0 = now;
        else if (now - *t0 > POOL_SPIN_NS) return 0;
    }
    _mm_pause();
    return 1;
}

/* Worker `id`, last region `last`: spin until the ticket's generation changes (returns the new
 * ticket) or the window passes (returns `last`: block). No spin unless it ran a chunk of `last`
 * and `last` allowed spinning. */
static uint64_t pool_spin_ticket(int id, uint64_t last) {
    if (!(last & TICKET_SPIN) || id >= TICKET_CHUNKS(last)) return last;
    uint64_t t0 = 0;
    for (unsigned i = 0; pool_spin_step(i, &t0); i++) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if (TICKET_GEN(t) != TICKET_GEN(last)) return t;
    }
    return last;
}

static void *pool_worker(void *p) {
    int id = (int)(intptr_t)p;
    uint64_t last = pool.start_ticket[id]; /* a region it had no chunk in: it blocks first */
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
        if (id >= TICKET_CHUNKS(t)) continue; /* no chunk for this worker in this region */
        pool.fn(pool.arg, id);
        if (atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool.mu); /* last one: wake the caller if it went to sleep */
            if (pool.caller_waits) pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

static void run_chunks(chunk_fn fn, void *arg, int n) {
    if (n <= 1) {
        fn(arg, 0);
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
    pool.fn = fn, pool.arg = arg;
    atomic_store_explicit(&pool.pending, handed, memory_order_relaxed);
    atomic_store_explicit(&pool.ticket,
                          (uint64_t)(TICKET_GEN(cur) + 1) << 32 | (spin ? TICKET_SPIN : 0) |
                              (uint32_t)(handed + 1),
                          memory_order_release);
    if (pool.sleepers) pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    fn(arg, 0);
    for (int c = handed + 1; c < n; c++) fn(arg, c);
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

/* ---- the pipeline ---- */

/* Rows [r0, r1) of chunk c of `rows` split in `n` pieces, each a multiple of 16 rows: t158's
 * avx512 kernel runs 16-row blocks and pads a shorter tail, so aligned chunks save that work
 * (results never depend on the chunking; every row kernel computes a row on its own). */
static void chunk_rows(int rows, int n, int c, int *r0, int *r1) {
    int step = (rows + n - 1) / n;
    step = (step + 15) & ~15;
    *r0 = c * step < rows ? c * step : rows;
    *r1 = (c + 1) * step < rows ? (c + 1) * step : rows;
}

static int clamp_threads(int threads, int rows) {
    int most = (rows + 1) / 2;
    if (threads > most) threads = most;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    return threads < 1 ? 1 : threads;
}

/* X[n, cols] -> a 64-byte aligned copy with row stride ld (a multiple of 16 floats, at least
 * cols + XPAD) and zeros after each row. */
static float *padded_rows(const float *X, int n, int cols, int *ld) {
    *ld = (cols + XPAD + 15) / 16 * 16;
    float *p = aligned_alloc(64, (size_t)n * *ld * 4);
    if (!p) return NULL;
    for (int t = 0; t < n; t++) {
        memcpy(p + (size_t)t * *ld, X + (size_t)t * cols, (size_t)cols * 4);
        memset(p + (size_t)t * *ld + cols, 0, (size_t)(*ld - cols) * 4);
    }
    return p;
}

typedef struct {
    rows_fn fn;
    const mat_t *m;
    const float *X;
    int ldx, n, nchunks;
    float *Y, *scratch;
    int ldy;
} gemm_job;

static void gemm_chunk(void *arg, int c) {
    const gemm_job *j = arg;
    int r0, r1;
    chunk_rows(j->m->rows, j->nchunks, c, &r0, &r1);
    if (r1 > r0)
        j->fn(j->m, j->X, j->ldx, j->n, j->Y, j->ldy, r0, r1,
              j->scratch + c * scratch_floats(j->m->cols));
}

static int prepare(mat_t *m) {
    if (m->rows <= 0 || m->cols <= 0 || m->cols % BLOCK) return -1;
    return codec_prepare(m);
}

int mtplx_cpu_gemm(const void *packed, const void *scale, const void *zero, int rows, int cols,
                   int bits, int layout, const float *X, int n, float *Y, int threads) {
    mat_t m = {packed, scale, zero, rows, cols, bits, layout, 0, 0};
    int rc = prepare(&m);
    if (rc) return rc;
    if (n <= 0) return -1;
    int ldx;
    threads = clamp_threads(threads, rows);
    float *xp = padded_rows(X, n, cols, &ldx);
    float *scratch = aligned_alloc(64, threads * scratch_floats(cols) * 4);
    if (!xp || !scratch) {
        free(xp), free(scratch);
        return -2;
    }
    gemm_job j = {codec_rows(&m, mtplx_cpu_get_isa()), &m, xp, ldx, n, threads, Y, scratch,
                  rows};
    run_chunks(gemm_chunk, &j, threads);
    free(xp), free(scratch);
    return 0;
}

typedef struct {
    rows_fn fn_in, fn_down;
    const mat_t *gate, *up, *down;
    const float *X;
    float *G, *U, *H, *out, *scratch; /* scratch: one block per chunk, for the wider of R, I */
    int ldx, ldh, n, R, I, round_model, nchunks;
    float beta, beta_lin;
} expert_job;

/* Gate and up rows of this chunk for every token, then SiTU-GLU on the same rows: h[t, i]
 * needs only gate row i and up row i, so no barrier is needed before the activation. */
static void gate_up_chunk(void *arg, int c) {
    const expert_job *j = arg;
    int r0, r1;
    chunk_rows(j->I, j->nchunks, c, &r0, &r1);
    if (r1 <= r0) return;
    float *scratch = j->scratch + c * scratch_floats(j->R > j->I ? j->R : j->I);
    j->fn_in(j->gate, j->X, j->ldx, j->n, j->G, j->ldh, r0, r1, scratch);
    j->fn_in(j->up, j->X, j->ldx, j->n, j->U, j->ldh, r0, r1, scratch);
    for (int t = 0; t < j->n; t++) {
        const float *g = j->G + (size_t)t * j->ldh, *u = j->U + (size_t)t * j->ldh;
        float *h = j->H + (size_t)t * j->ldh;
        for (int i = r0; i < r1; i++) {
            float gi = g[i], ui = u[i];
            if (j->round_model) gi = round_bf16(gi), ui = round_bf16(ui);
            float v = situ_glu(gi, ui, j->beta, j->beta_lin);
            h[i] = j->round_model ? round_bf16(v) : v;
        }
    }
}

static void down_chunk(void *arg, int c) {
    const expert_job *j = arg;
    int r0, r1;
    chunk_rows(j->R, j->nchunks, c, &r0, &r1);
    if (r1 <= r0) return;
    j->fn_down(j->down, j->H, j->ldh, j->n, j->out, j->R, r0, r1,
               j->scratch + c * scratch_floats(j->R > j->I ? j->R : j->I));
    if (j->round_model)
        for (int t = 0; t < j->n; t++)
            for (int r = r0; r < r1; r++) {
                float *y = j->out + (size_t)t * j->R + r;
                *y = round_bf16(*y);
            }
}

int mtplx_cpu_expert(const void *const *mats, int R, int I, int bits, int layout,
                     const float *X, int n, float *out, float beta, float beta_lin,
                     int round_model, int threads) {
    mat_t gate = {mats[0], mats[1], mats[2], I, R, bits, layout, 0, 0};
    mat_t up = {mats[3], mats[4], mats[5], I, R, bits, layout, 0, 0};
    mat_t down = {mats[6], mats[7], mats[8], R, I, bits, layout, 0, 0};
    int rc;
    if ((rc = prepare(&gate)) || (rc = prepare(&up)) || (rc = prepare(&down))) return rc;
    if (n <= 0) return -1;
    int ldx, ldh = (I + XPAD + 15) / 16 * 16;
    int chunks = clamp_threads(threads, R < I ? R : I); /* at most this many per region */
    float *xp = padded_rows(X, n, R, &ldx);
    float *buf = aligned_alloc(64, (size_t)3 * n * ldh * 4);
    float *scratch = aligned_alloc(64, chunks * scratch_floats(R > I ? R : I) * 4);
    if (!xp || !buf || !scratch) {
        free(xp), free(buf), free(scratch);
        return -2;
    }
    /* G, U are fully written for columns < I; H's pad columns must read as zeros. */
    memset(buf, 0, (size_t)3 * n * ldh * 4);
    int isa = mtplx_cpu_get_isa();
    expert_job j = {codec_rows(&gate, isa), codec_rows(&down, isa), &gate, &up, &down, xp,
                    buf, buf + (size_t)n * ldh, buf + (size_t)2 * n * ldh, out, scratch,
                    ldx, ldh, n, R, I, round_model, chunks, beta, beta_lin};
    run_chunks(gate_up_chunk, &j, chunks);
    run_chunks(down_chunk, &j, chunks);
    free(xp), free(buf), free(scratch);
    return 0;
}

#endif
