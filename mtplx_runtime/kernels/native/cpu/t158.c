/* t158 CPU kernels: GEMV and the K3 expert MLP computed directly on the packed bytes.
 *
 * Format: FORMAT.md "t158". Row r of a [rows, cols] projection is G = cols/64 groups of 13
 * base-3 bytes plus one bf16 scale:
 *   y[r] = Σ_g fp32(scale[r,g]) · Σ_i trit(r,g,i) · x[64g+i],  trit = floor(b/3^k) mod 3 − 1,
 * with bytes 0..11 holding 5 trits and byte 12 holding 4 (its digit 4 is ignored; bytes 243..255
 * decode by the same rule). fp32 accumulation throughout; no dequantized copy is made.
 *
 * Paths (picked at run time with __builtin_cpu_supports, forced lower by mtplx_cpu_set_isa):
 *   0 scalar  : 256x5 float trit table, one row at a time.
 *   1 avx2    : 256x8 float table (5 trits + 3 zeros) times 8 unaligned inputs, FMA per byte.
 *   2 avx512  : t16f ("transposed T-MAC", t158_t16f.c, from tools/kernel_lab): 16 rows in the
 *               zmm lanes, per-input-vector fp32 tables of every 5-trit partial dot product,
 *               looked up with vpermps / vpermi2ps. Needs AVX-512 F/BW/DQ (else avx2).
 * scalar / avx2: n tokens (prefill) loop over the tokens inside each row pair, so the weights are
 * read from memory once per call. avx512: see t158_rows_avx512. This file supplies the codec's
 * hooks (t158_prepare, t158_rows); threads, SiTU-GLU, model rounding and the exported ABI are
 * the driver's (expert.c).
 */
#include <pthread.h>

#include "cpu_common.h"
#include "t158_t16f.h"

#define GB 13 /* bytes per group */
#define GE 64 /* weights per group */

static float LUT5[256][5];                        /* trit k of byte b */
static float LUT8[256][8] __attribute__((aligned(32)));   /* digits 0..4, lanes 5..7 zero */
static float LUT8L[256][8] __attribute__((aligned(32)));  /* byte 12: digits 0..3 only */
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;

static void init_luts(void) {
    for (int b = 0; b < 256; b++) {
        int v = b;
        for (int k = 0; k < 5; k++, v /= 3) {
            float t = (float)(v % 3 - 1);
            LUT5[b][k] = t;
            LUT8[b][k] = t;
            LUT8L[b][k] = k < 4 ? t : 0.0f;
        }
        for (int k = 5; k < 8; k++) LUT8[b][k] = LUT8L[b][k] = 0.0f;
    }
}

/* One token's rows [r0, r1): the single-vector kernels below, unchanged by the n-token API. */
typedef void (*vec_fn)(const uint8_t *, const uint16_t *, int, const float *, float *, int, int);

static void rows_scalar(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                        int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = pk + (size_t)r * G * GB;
        const uint16_t *s = sc + (size_t)r * G;
        float acc = 0.0f;
        for (int g = 0; g < G; g++, p += GB) {
            const float *xg = x + (size_t)g * GE;
            float sum = 0.0f;
            for (int j = 0; j < 12; j++) {
                const float *t = LUT5[p[j]], *xx = xg + 5 * j;
                sum += t[0] * xx[0] + t[1] * xx[1] + t[2] * xx[2] + t[3] * xx[3] + t[4] * xx[4];
            }
            const float *t = LUT5[p[12]], *xx = xg + 60;
            sum += t[0] * xx[0] + t[1] * xx[1] + t[2] * xx[2] + t[3] * xx[3];
            acc += bf16f(s[g]) * sum;
        }
        y[r] = acc;
    }
}

__attribute__((target("avx2,fma"))) static void rows_avx2(const uint8_t *pk, const uint16_t *sc,
                                                          int G, const float *x, float *y,
                                                          int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = pk + (size_t)r * G * GB;
        const uint16_t *s = sc + (size_t)r * G;
        __m256 acc = _mm256_setzero_ps();
        for (int g = 0; g < G; g++, p += GB) {
            const float *xg = x + (size_t)g * GE;
            __m256 a0 = _mm256_mul_ps(_mm256_load_ps(LUT8[p[0]]), _mm256_loadu_ps(xg));
            __m256 a1 = _mm256_mul_ps(_mm256_load_ps(LUT8[p[1]]), _mm256_loadu_ps(xg + 5));
            for (int j = 2; j < 12; j += 2) {
                a0 = _mm256_fmadd_ps(_mm256_load_ps(LUT8[p[j]]), _mm256_loadu_ps(xg + 5 * j), a0);
                a1 = _mm256_fmadd_ps(_mm256_load_ps(LUT8[p[j + 1]]),
                                     _mm256_loadu_ps(xg + 5 * j + 5), a1);
            }
            a0 = _mm256_fmadd_ps(_mm256_load_ps(LUT8L[p[12]]), _mm256_loadu_ps(xg + 60), a0);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(bf16f(s[g])), _mm256_add_ps(a0, a1), acc);
        }
        y[r] = hsum256(acc);
    }
}

/* n tokens: each row pair's bytes are read from memory once and stay in L1 while every token
 * runs the single-vector kernel on them, so per token the arithmetic (and the result) is that
 * of a one-token call. */
static inline void rows_tokens(vec_fn fn, const mat_t *m, const float *X, int ldx, int n,
                               float *Y, int ldy, int r0, int r1) { /* needs no scratch */
    const uint16_t *sc = (const uint16_t *)m->scale;
    for (int r = r0; r < r1; r += 2) {
        int re = r + 2 < r1 ? r + 2 : r1;
        for (int t = 0; t < n; t++)
            fn(m->packed, sc, m->cols / GE, X + (size_t)t * ldx, Y + (size_t)t * ldy, r, re);
    }
}

static void t158_rows_scalar(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                             int r0, int r1, float *scratch) {
    (void)scratch;
    rows_tokens(rows_scalar, m, X, ldx, n, Y, ldy, r0, r1);
}

static void t158_rows_avx2(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                           int r0, int r1, float *scratch) {
    (void)scratch;
    rows_tokens(rows_avx2, m, X, ldx, n, Y, ldy, r0, r1);
}

/* avx512 (t16f). Each call builds the tables of its input vectors itself, per thread, into a
 * per-thread buffer that persists across calls (thread_floats): three tables per expert
 * per thread (gate and up each build x's, down builds h's), a small cost (BENCHMARKS.md, "CPU
 * kernel notes") that keeps the driver unchanged (no input stage before the parallel region, no
 * per-call allocation: per call, a buffer of n tables would be an mmap plus page faults). Tables are per token and a token's rows see only its own tables, so per token
 * the arithmetic is that of a one-token call whatever n, r0, r1 are; t16f_span sends every row
 * through the same 16-lane code (tails padded), so no row alignment of the chunks is needed.
 * n > 1: tokens go in batches of T16F_TOKENS (one table each, 140 KB at K3), and within a batch
 * rows in tiles of T16F_TILE: each tile's bytes (93 KB at K3) are read from memory once and stay
 * in L2 while every token of the batch runs over them. */
#define T16F_TOKENS 8
#define T16F_TILE 128 /* a multiple of 16 */

static void t158_rows_avx512(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                             int r0, int r1, float *scratch) {
    const uint8_t *pk = m->packed;
    const uint16_t *sc = (const uint16_t *)m->scale;
    int G = m->cols / GE;
    size_t tabf = T16F_TAB_FLOATS(G);
    int tc = n < T16F_TOKENS ? n : T16F_TOKENS;
    float *tab = thread_floats(THREAD_BUF_T158_TABLES, tc * tabf);
    if (!tab && tc > 1) tab = thread_floats(THREAD_BUF_T158_TABLES, tabf), tc = 1;
    if (!tab) { /* out of memory for even one table (140 KB at K3): correct, other rounding */
        rows_tokens(rows_avx2, m, X, ldx, n, Y, ldy, r0, r1);
        return;
    }
    for (int t0 = 0; t0 < n; t0 += tc) {
        int nt = n - t0 < tc ? n - t0 : tc;
        for (int t = 0; t < nt; t++) t16f_tables(X + (size_t)(t0 + t) * ldx, G, tab + t * tabf);
        if (nt == 1) {
            t16f_span(pk, sc, G, tab, Y + (size_t)t0 * ldy, r0, r1, r1, scratch);
            continue;
        }
        for (int a = r0; a < r1; a += T16F_TILE) {
            int b = r1 - a < T16F_TILE ? r1 : a + T16F_TILE;
            for (int t = 0; t < nt; t++)
                t16f_span(pk, sc, G, tab + t * tabf, Y + (size_t)(t0 + t) * ldy, a, b, r1,
                          scratch);
        }
    }
}

static void init_once(void) {
    init_luts();
    t16f_init();
}

int t158_prepare(mat_t *m) {
    pthread_once(&lut_once, init_once);
    m->row_bytes = (size_t)m->cols / GE * GB;
    m->scale_row_bytes = (size_t)m->cols / GE * 2;
    return 0;
}

static int has_t16f(void) { /* AVX-512 F/DQ (isa 2) and BW */
    static int ok = -1;
    if (ok < 0) {
        __builtin_cpu_init();
        ok = __builtin_cpu_supports("avx512bw");
    }
    return ok;
}

rows_fn t158_rows(const mat_t *m, int isa) {
    /* the driver's per-thread scratch (scratch_floats) covers t16f_span's (asserted here) */
    if (isa >= 2 && has_t16f() && T16F_SCRATCH_FLOATS(m->cols / GE) <= scratch_floats(m->cols))
        return t158_rows_avx512;
    return isa >= 1 ? t158_rows_avx2 : t158_rows_scalar;
}
