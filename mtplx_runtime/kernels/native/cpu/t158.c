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
 *   1 avx2    : 256x8 float table (5 trits + 3 zeros) times the byte's 5 inputs, FMA per byte;
 *               the inputs are laid out once per call as 8 aligned floats per byte, and 4 rows
 *               share each input load (t158_rows_avx2).
 *   2 avx512  : t16f ("transposed T-MAC", t158_t16f.c, from tools/kernel_lab): 16 rows in the
 *               zmm lanes, per-input-vector fp32 tables of every 5-trit partial dot product,
 *               looked up with vpermps / vpermi2ps. Needs AVX-512 F/BW/DQ (else avx2).
 * scalar: n tokens (prefill) loop over the tokens inside each row pair, so the weights are read
 * from memory once per call. avx2: see t158_rows_avx2; avx512: see t158_rows_avx512. This file
 * supplies the codec's hooks (t158_prepare, t158_rows); threads, SiTU-GLU, model rounding and
 * the exported ABI are the driver's (expert.c).
 */
#include <pthread.h>

#include "cpu_common.h"
#include "t158_t16f.h"

#define GB 13 /* bytes per group */
#define GE 64 /* weights per group */

static float LUT5[256][5];                        /* trit k of byte b */
static float LUT8[256][8] __attribute__((aligned(32)));   /* digits 0..4, lanes 5..7 zero */
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;

static void init_luts(void) {
    for (int b = 0; b < 256; b++) {
        int v = b;
        for (int k = 0; k < 5; k++, v /= 3) {
            float t = (float)(v % 3 - 1);
            LUT5[b][k] = t;
            LUT8[b][k] = t;
        }
        for (int k = 5; k < 8; k++) LUT8[b][k] = 0.0f;
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

/* avx2. Per token, x is laid out as 8 floats per packed byte (xp[8c + k] = the input of digit k
 * of byte column c = 13g + j, zeros past the byte's 5 digits, or its 4 for byte 12), so every
 * lookup multiplies one aligned load, digit 4 of byte 12 meets a zero, and NR rows share each
 * load. Per row the sums are those of one row at a time: per group two chains (even bytes, odd
 * bytes) and one FMA by the scale. NR rows run at once so that the FMA chains overlap. While a
 * block of rows runs (for the last token of a batch), the next block is prefetched into L1, one
 * line per group: from DRAM, without it the kernel waits on memory (benchmarks log, "CPU kernel
 * notes"). */
#define T8_ROWS 4
#define T8_TOKENS 8                       /* tokens whose layouts share a pass over the rows */
/* one token's layout, 104G floats: always inside the driver's scratch_floats(64G) = 256G + 64 */
#define T8_XP_FLOATS(G) ((size_t)(G) * GB * 8)

__attribute__((target("avx2,fma"))) static void t8_layout(const float *x, int G, float *xp) {
    for (int g = 0; g < G; g++)
        for (int j = 0; j < GB; j++) /* x is XPAD-padded: byte 12 of the last group reads 4 past */
            _mm256_store_ps(xp + ((size_t)g * GB + j) * 8,
                            _mm256_blend_ps(_mm256_setzero_ps(),
                                            _mm256_loadu_ps(x + (size_t)g * GE + 5 * j),
                                            j < 12 ? 0x1F : 0x0F));
}

/* LUT8[byte j] of a row's group, whose 13 bytes are w[0] (bytes 0..7) and w[1] (5..12): a shift
 * and a mask of the byte's offset in LUT8 (j is a constant), no load of the byte itself. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) __m256
t8_lut(const uint64_t *w, int j) {
    uint64_t off = j == 0 ? w[0] << 5 : j < 8 ? w[0] >> (8 * j - 5) : w[1] >> (8 * (j - 5) - 5);
    return _mm256_load_ps((const float *)((const char *)LUT8 + (off & 0x1FE0)));
}

__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
t8_rows(const uint8_t *pk, const uint16_t *sc, int G, const float *xp, float *y, int r,
        int NR, const uint8_t *next) {
    const uint8_t *p[T8_ROWS];
    const uint16_t *s[T8_ROWS];
    __m256 acc[T8_ROWS];
    for (int i = 0; i < NR; i++) {
        p[i] = pk + (size_t)(r + i) * G * GB, s[i] = sc + (size_t)(r + i) * G;
        acc[i] = _mm256_setzero_ps();
    }
    for (int g = 0; g < G; g++) {
        const float *xg = xp + (size_t)g * GB * 8;
        __m256 a0[T8_ROWS], a1[T8_ROWS];
        uint64_t w[T8_ROWS][2]; /* bytes 0..7, bytes 5..12 */
        for (int i = 0; i < NR; i++) w[i][0] = load_u64(p[i]), w[i][1] = load_u64(p[i] + 5);
        if (next && 64 * g < NR * G * GB) _mm_prefetch((const char *)next + 64 * g, _MM_HINT_T0);
        __m256 x0 = _mm256_load_ps(xg), x1 = _mm256_load_ps(xg + 8);
        for (int i = 0; i < NR; i++) {
            a0[i] = _mm256_mul_ps(t8_lut(w[i], 0), x0);
            a1[i] = _mm256_mul_ps(t8_lut(w[i], 1), x1);
        }
#pragma GCC unroll 5 /* t8_lut's shifts need j as a constant */
        for (int j = 2; j < 12; j += 2) {
            x0 = _mm256_load_ps(xg + 8 * j), x1 = _mm256_load_ps(xg + 8 * j + 8);
            for (int i = 0; i < NR; i++) {
                a0[i] = _mm256_fmadd_ps(t8_lut(w[i], j), x0, a0[i]);
                a1[i] = _mm256_fmadd_ps(t8_lut(w[i], j + 1), x1, a1[i]);
            }
        }
        x0 = _mm256_load_ps(xg + 96);
        for (int i = 0; i < NR; i++) {
            a0[i] = _mm256_fmadd_ps(t8_lut(w[i], 12), x0, a0[i]);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(bf16f(s[i][g])), _mm256_add_ps(a0[i], a1[i]),
                                     acc[i]);
            p[i] += GB;
        }
    }
    for (int i = 0; i < NR; i++) y[r + i] = hsum256(acc[i]);
}

__attribute__((target("avx2,fma"))) static void t158_rows_avx2(const mat_t *m, const float *X,
                                                               int ldx, int n, float *Y, int ldy,
                                                               int r0, int r1, float *scratch) {
    const uint8_t *pk = m->packed;
    const uint16_t *sc = (const uint16_t *)m->scale;
    int G = m->cols / GE;
    size_t xf = T8_XP_FLOATS(G);
    int tc = n < T8_TOKENS ? n : T8_TOKENS;
    float *xp = tc > 1 ? thread_floats(THREAD_BUF_T158_TABLES, tc * xf) : NULL;
    if (!xp) xp = scratch, tc = 1; /* one token's layout fits the driver's scratch */
    for (int t0 = 0; t0 < n; t0 += tc) {
        int nt = n - t0 < tc ? n - t0 : tc;
        for (int t = 0; t < nt; t++) t8_layout(X + (size_t)(t0 + t) * ldx, G, xp + t * xf);
        for (int r = r0; r < r1; r += T8_ROWS) /* the block stays in L1 for the batch's tokens */
            for (int t = 0; t < nt; t++) {
                const float *x = xp + t * xf;
                float *y = Y + (size_t)(t0 + t) * ldy;
                const uint8_t *next = r + 2 * T8_ROWS <= r1 && t == nt - 1
                                          ? pk + (size_t)(r + T8_ROWS) * G * GB : NULL;
                switch (r1 - r < T8_ROWS ? r1 - r : T8_ROWS) {
                case 4: t8_rows(pk, sc, G, x, y, r, 4, next); break;
                case 3: t8_rows(pk, sc, G, x, y, r, 3, next); break;
                case 2: t8_rows(pk, sc, G, x, y, r, 2, next); break;
                default: t8_rows(pk, sc, G, x, y, r, 1, next);
                }
            }
    }
}

/* avx512 (t16f). The kernel reads per-token tables of the input, not the input itself. Tables
 * are per token and a token's rows see only its own tables, so per token the arithmetic is that
 * of a one-token call whatever n, r0, r1 are; t16f_span sends every row through the same
 * 16-lane code (tails padded), so no row alignment of the chunks is needed.
 * Up to T16F_TOKENS tokens, the tables are t158's input stage (T158_INPUT): the expert pipeline
 * builds them once per thread and input and passes them to every matrix and chunk that reads
 * that input (gate and up share x's), benchmarks log "t158 tables once per input". A plain row
 * call builds them itself into a per-thread buffer that persists across calls (thread_floats;
 * per call, a buffer of n tables would be an mmap plus page faults).
 * n > 1: tokens go in batches of T16F_TOKENS (one table each, 140 KB at K3), and within a batch
 * rows in tiles of T16F_TILE: each tile's bytes (93 KB at K3) are read from memory once and stay
 * in L2 while every token of the batch runs over them. */
#define T16F_TOKENS 8
#define T16F_TILE 128 /* a multiple of 32: t16f_span pads what is left after its last 32 rows */

static void t158_rows_avx512(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                             int r0, int r1, float *scratch);

/* The tables of n <= T16F_TOKENS tokens: n * T16F_TAB_FLOATS(G) floats; 0 where the avx512
 * kernel does not run (the stage is then not used). */
static size_t t158_input_floats(const mat_t *m, int n, int isa) {
    if (n > T16F_TOKENS || t158_rows(m, isa) != t158_rows_avx512) return 0;
    return (size_t)n * T16F_TAB_FLOATS(m->cols / GE);
}

static void t158_input_build(const mat_t *m, const float *X, int ldx, int n, float *tab) {
    int G = m->cols / GE;
    for (int t = 0; t < n; t++) t16f_tables(X + (size_t)t * ldx, G, tab + t * T16F_TAB_FLOATS(G));
}

/* Y rows [r0, r1) of n <= T16F_TOKENS tokens from their tables. */
static void t158_rows_tables(const mat_t *m, const float *tab, int n, float *Y, int ldy, int r0,
                             int r1, float *scratch) {
    const uint8_t *pk = m->packed;
    const uint16_t *sc = (const uint16_t *)m->scale;
    int G = m->cols / GE;
    size_t tabf = T16F_TAB_FLOATS(G);
    if (n == 1) {
        t16f_span(pk, sc, G, tab, Y, r0, r1, r1, scratch);
        return;
    }
    for (int a = r0; a < r1; a += T16F_TILE) {
        int b = r1 - a < T16F_TILE ? r1 : a + T16F_TILE;
        for (int t = 0; t < n; t++)
            t16f_span(pk, sc, G, tab + t * tabf, Y + (size_t)t * ldy, a, b, r1, scratch);
    }
}

const input_stage T158_INPUT = {t158_input_floats, t158_input_build, t158_rows_tables};

static void t158_rows_avx512(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                             int r0, int r1, float *scratch) {
    size_t tabf = T16F_TAB_FLOATS(m->cols / GE);
    int tc = n < T16F_TOKENS ? n : T16F_TOKENS;
    float *tab = thread_floats(THREAD_BUF_T158_TABLES, tc * tabf);
    if (!tab && tc > 1) tab = thread_floats(THREAD_BUF_T158_TABLES, tabf), tc = 1;
    if (!tab) { /* out of memory for even one table (140 KB at K3): correct, other rounding */
        t158_rows_avx2(m, X, ldx, n, Y, ldy, r0, r1, scratch);
        return;
    }
    for (int t0 = 0; t0 < n; t0 += tc) {
        int nt = n - t0 < tc ? n - t0 : tc;
        t158_input_build(m, X + (size_t)t0 * ldx, ldx, nt, tab);
        t158_rows_tables(m, tab, nt, Y + (size_t)t0 * ldy, ldy, r0, r1, scratch);
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

rows_fn t158_rows(const mat_t *m, int isa) {
    /* the driver's per-thread scratch (scratch_floats) covers t16f_span's (asserted here) */
    if (isa >= 2 && cpu_has_avx512bw() &&
        T16F_SCRATCH_FLOATS(m->cols / GE) <= scratch_floats(m->cols))
        return t158_rows_avx512;
    return isa >= 1 ? t158_rows_avx2 : t158_rows_scalar;
}
