/* t158 CPU kernels: GEMV and the K3 expert MLP computed directly on the packed bytes.
 *
 * Format: FORMAT.md "t158" (spec/t158-and-streaming.md §1, §1.10). Row r of a [rows, cols]
 * projection is G = cols/64 groups of 13 base-3 bytes plus one bf16 scale:
 *   y[r] = Σ_g fp32(scale[r,g]) · Σ_i trit(r,g,i) · x[64g+i],  trit = floor(b/3^k) mod 3 − 1,
 * with bytes 0..11 holding 5 trits and byte 12 holding 4 (its digit 4 is ignored; bytes 243..255
 * decode by the same rule). fp32 accumulation throughout; no dequantized copy is made.
 *
 * Paths (picked at run time with __builtin_cpu_supports, forced lower by mtplx_cpu_set_isa):
 *   0 scalar  : 256x5 float trit table, one row at a time.
 *   1 avx2    : 256x8 float table (5 trits + 3 zeros) times 8 unaligned inputs, FMA per byte.
 *   2 avx512  : the avx2 scheme on two rows at once (one row per 256-bit half of a zmm).
 * n tokens (prefill) loop over the tokens inside each row pair, so the weights are read from
 * memory once per call. Threads, SiTU-GLU, model rounding and the exported ABI come from
 * expert_common.h. Built by mtplx_runtime/kernels/cpu_build.py.
 */
#include "expert_common.h"

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

__attribute__((target("avx512f,avx512dq,avx2,fma"))) static inline __m512
pair(const float *t0, const float *t1) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(t0)), _mm256_load_ps(t1), 1);
}

__attribute__((target("avx512f,avx512dq,avx2,fma"))) static void
rows_avx512(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y, int r0,
            int r1) {
    int r = r0;
    size_t stride = (size_t)G * GB;
    for (; r + 1 < r1; r += 2) {
        const uint8_t *p = pk + (size_t)r * stride, *q = p + stride;
        const uint16_t *s = sc + (size_t)r * G, *u = s + G;
        __m512 acc = _mm512_setzero_ps();
        for (int g = 0; g < G; g++, p += GB, q += GB) {
            const float *xg = x + (size_t)g * GE;
            __m512 a0 = _mm512_mul_ps(pair(LUT8[p[0]], LUT8[q[0]]),
                                      _mm512_broadcast_f32x8(_mm256_loadu_ps(xg)));
            __m512 a1 = _mm512_mul_ps(pair(LUT8[p[1]], LUT8[q[1]]),
                                      _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 5)));
            for (int j = 2; j < 12; j += 2) {
                a0 = _mm512_fmadd_ps(pair(LUT8[p[j]], LUT8[q[j]]),
                                     _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 5 * j)), a0);
                a1 = _mm512_fmadd_ps(pair(LUT8[p[j + 1]], LUT8[q[j + 1]]),
                                     _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 5 * j + 5)), a1);
            }
            a0 = _mm512_fmadd_ps(pair(LUT8L[p[12]], LUT8L[q[12]]),
                                 _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 60)), a0);
            __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(bf16f(s[g])),
                                           _mm256_set1_ps(bf16f(u[g])), 1);
            acc = _mm512_fmadd_ps(sv, _mm512_add_ps(a0, a1), acc);
        }
        y[r] = hsum256(_mm512_castps512_ps256(acc));
        y[r + 1] = hsum256(_mm512_extractf32x8_ps(acc, 1));
    }
    if (r < r1) rows_avx2(pk, sc, G, x, y, r, r1);
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

static void t158_rows_avx512(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                             int r0, int r1, float *scratch) {
    (void)scratch;
    rows_tokens(rows_avx512, m, X, ldx, n, Y, ldy, r0, r1);
}

static int codec_prepare(mat_t *m) {
    pthread_once(&lut_once, init_luts);
    m->row_bytes = (size_t)m->cols / GE * GB;
    m->scale_row_bytes = (size_t)m->cols / GE * 2;
    return 0;
}

static rows_fn codec_rows(const mat_t *m, int isa) {
    (void)m;
    return isa >= 2 ? t158_rows_avx512 : isa == 1 ? t158_rows_avx2 : t158_rows_scalar;
}
