/* t158 ternary GEMV inner-loop lab: numbered variants, a scalar reference, a timing harness.
 *
 * Build and run (from the repository root):
 *   gcc -O3 -march=native -pthread tools/kernel_lab/t158_lab.c -o /tmp/t158_lab -lm
 *   /tmp/t158_lab [experts=16] [passes=7] [variant=-1]   (validation + full-expert timing)
 *   /tmp/t158_lab micro [variant]    /tmp/t158_lab micron N
 *
 * Format (FORMAT.md "t158"): row r of a [rows, cols] projection is G = cols/64 groups of 13
 * base-3 bytes plus one bf16 scale; trit k of byte b = floor(b/3^k) mod 3 - 1; byte 12 of a
 * group uses digits 0..3 only; bytes 243..255 decode by the same rule.
 *   y[r] = sum_g fp32(scale[r,g]) * sum_i trit(r,g,i) * x[64g+i]      (x stays fp32)
 *
 * Every variant has the signature of kernels/native/cpu/t158.c's row functions plus a `prep`
 * pointer (per-input precomputation shared by all rows; NULL for variants that need none):
 *   rows(packed, scales, G, x, y, r0, r1, prep)
 * and an optional prep builder run (split over threads) once per input vector.
 *
 * Variants
 *   0 scalar    the current scalar path (256x5 float trit table), also the timing floor
 *   1 avx512    the current best path of t158_cpu.c (256x8 float table, two rows per zmm)
 *   2 tmac      T-MAC: per 5-input chunk c a 256-entry fp32 table tab[c][b] = sum_k trit_k(b)
 *               x[5c+k]; a packed byte costs one table load + one scalar add. Tables for all
 *               chunks (cols/64*13 KB: 728 KB for cols=3584) live in L2.
 *   3 tmac-blk  variant 2 with column blocking: NB groups' tables (13 KB each) stay in L1 while
 *               all rows of the thread sweep past them; partial y accumulated in memory.
 *   4 tmac-gth  variant 2 with one AVX-512 gather per (row, group): 13 table loads in one
 *               vgatherdps, indices = byte + 256*j.
 *   5 mask      AVX-512 VBMI/BITALG masks: two 256-entry byte tables (P: digits == 2, M:
 *               digits == 0, 5 bits each) via vpermt2b, then vpshufbitqmb turns them into one
 *               64-bit "+1" mask and one "-1" mask per group; sum = masked adds of x - masked
 *               adds of x. No trit is ever materialised; 64 weights cost ~14 vector ops.
 *   6 mask2     variant 5 on two rows at once (x loads shared, two independent chains).
 *   7 t16       transposed T-MAC: 16 rows in the 16 fp32 lanes; per 5-input chunk a 16-entry
 *               (lo = b mod 9) and a 32-entry (hi = b / 9) fp32 table, looked up for 16 rows
 *               at once by vpermps / vpermi2ps after a 16x16 byte transpose of the rows.
 *   8 t16d      7 with a 16x16 dword transpose + shifts instead of a byte spread.
 *   9 t16c      8 with column blocking (tables in L1).                      (no gain)
 *  10 t16x      8 with arithmetic lo/hi split, vector scale transpose, vector table build.
 *  11 t16x2     10 sharing table loads between 32 rows.                    (no gain)
 *  12 t16f      10 with FMAs into 8 rotating accumulators: the winner.
 *  13 t16f-self 12 building its tables inside the row function (port signature).
 *
 * Modes: `micro [v]` times rows() on a cache-resident [256, 3584] matrix, single thread, in
 * cycles per (row, group); `micron N` runs the N-token form of variant 12 (rows_t16f_n).
 * Results and reasoning: tools/kernel_lab/README.md.
 *
 * The harness builds `experts` random K3 experts (gate/up [3072, 3584], down [3584, 3072]; all
 * byte values 0..255 so the 243..255 rule and the ignored digit 4 of byte 12 are exercised),
 * validates every variant against a double-precision scalar decode (relative RMS), then times
 * the full expert (gate+up GEMV, SiTU-GLU, down GEMV, T=1) with 1 and 2 threads, cycling over
 * the experts so the weights come from DRAM (experts*7.7 MB > 32 MB L3), best of `passes`.
 * Memory bandwidth is measured in the same run like tools/bench_kernels.py: a 1 GiB copy
 * (read+write bytes / time); a 2-thread read-only sum is printed as a second reference.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define GB 13
#define GE 64
#define XPAD 64 /* zero floats after x and h */
#define MAXG 1024
#ifndef T16F_PF_SCALES
#define T16F_PF_SCALES 1
#endif
#ifndef T16F_PF_DIST
#define T16F_PF_DIST 1
#endif
#ifndef T16F_PF_HINT
#define T16F_PF_HINT _MM_HINT_T0
#endif
#ifndef T16_PREFETCH
#define T16_PREFETCH 1
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline float bf16f(uint16_t u) {
    uint32_t w = (uint32_t)u << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
}

static int digit(int b, int k) {
    for (int i = 0; i < k; i++) b /= 3;
    return b % 3;
}

typedef void (*rows_fn)(const uint8_t *, const uint16_t *, int, const float *, float *, int, int,
                        const void *);
/* Build the per-input precomputation for chunks [c0, c1) of x (chunk = 5 inputs of one group). */
typedef void (*prep_fn)(const float *x, int G, void *buf, int g0, int g1);

/* ---------------------------------------------------------------- 0: scalar (current) */
static float LUT5[256][5];
static float LUT8[256][8] __attribute__((aligned(32)));
static float LUT8L[256][8] __attribute__((aligned(32)));

static void init_luts(void) {
    for (int b = 0; b < 256; b++) {
        for (int k = 0; k < 5; k++) {
            float t = (float)(digit(b, k) - 1);
            LUT5[b][k] = t;
            LUT8[b][k] = t;
            LUT8L[b][k] = k < 4 ? t : 0.0f;
        }
        for (int k = 5; k < 8; k++) LUT8[b][k] = LUT8L[b][k] = 0.0f;
    }
}

static void rows_scalar(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                        int r0, int r1, const void *prep) {
    (void)prep;
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

/* ---------------------------------------------------------------- 1: avx512 (current best) */
static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

static inline __m512 pair(const float *t0, const float *t1) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(t0)), _mm256_load_ps(t1), 1);
}

static void rows_avx512(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                        int r0, int r1, const void *prep) {
    size_t stride = (size_t)G * GB;
    int r = r0;
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
    if (r < r1) rows_scalar(pk, sc, G, x, y, r, r1, prep);
}

/* ---------------------------------------------------------------- 2-4: T-MAC tables */
/* tab[(13g + j) * 256 + b] = sum_k trit_k(b) * x[64g + 5j + k], k < 5 (k < 4 for j = 12).
 * Built level by level (3, 9, 27, 81, 243 entries: each level is three shifted copies of the
 * previous one, -x, 0, +x), so it vectorises; entries 243..255 copy 0..12 (b and b-243 have the
 * same digits 0..4 because 243 = 3^5). */
static void prep_tmac(const float *x, int G, void *buf, int g0, int g1) {
    (void)G;
    float *tab = buf;
    for (int g = g0; g < g1; g++) {
        for (int j = 0; j < GB; j++) {
            const float *xx = x + 64 * g + 5 * j;
            float *t = tab + ((size_t)g * GB + j) * 256;
            float l[243];
            l[0] = -xx[0], l[1] = 0.0f, l[2] = xx[0];
            int n = 3;
            int nk = j == 12 ? 4 : 5;
            for (int k = 1; k < 5; k++, n *= 3) {
                float v = k < nk ? xx[k] : 0.0f;
                float *dst = k == 4 ? t : l;
                if (k == 4) {
                    for (int i = 0; i < n; i++) {
                        dst[i] = l[i] - v;
                        dst[n + i] = l[i];
                        dst[2 * n + i] = l[i] + v;
                    }
                } else {
                    for (int i = 0; i < n; i++) {
                        l[n + i] = l[i];
                        l[2 * n + i] = l[i] + v;
                        l[i] = l[i] - v;
                    }
                }
            }
            for (int i = 0; i < 13; i++) t[243 + i] = t[i];
        }
    }
}

static inline uint64_t ld64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* One group of one row: 13 table loads + adds, 4 chains. Bytes 8..12 come from a second
 * 8-byte load at p+5 so nothing past the group is read. */
static inline float tmac_group(const uint8_t *p, const float *T) {
    uint64_t w0 = ld64(p), w1 = ld64(p + 5) >> 24;
    float s0 = T[0 * 256 + (w0 & 255)];
    float s1 = T[1 * 256 + ((w0 >> 8) & 255)];
    float s2 = T[2 * 256 + ((w0 >> 16) & 255)];
    float s3 = T[3 * 256 + ((w0 >> 24) & 255)];
    s0 += T[4 * 256 + ((w0 >> 32) & 255)];
    s1 += T[5 * 256 + ((w0 >> 40) & 255)];
    s2 += T[6 * 256 + ((w0 >> 48) & 255)];
    s3 += T[7 * 256 + (w0 >> 56)];
    s0 += T[8 * 256 + (w1 & 255)];
    s1 += T[9 * 256 + ((w1 >> 8) & 255)];
    s2 += T[10 * 256 + ((w1 >> 16) & 255)];
    s3 += T[11 * 256 + ((w1 >> 24) & 255)];
    s0 += T[12 * 256 + ((w1 >> 32) & 255)];
    return (s0 + s1) + (s2 + s3);
}

static void rows_tmac(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                      int r0, int r1, const void *prep) {
    (void)x;
    const float *tab = prep;
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = pk + (size_t)r * G * GB;
        const uint16_t *s = sc + (size_t)r * G;
        float acc0 = 0.0f, acc1 = 0.0f;
        int g = 0;
        for (; g + 1 < G; g += 2, p += 2 * GB) {
            acc0 += bf16f(s[g]) * tmac_group(p, tab + (size_t)g * GB * 256);
            acc1 += bf16f(s[g + 1]) * tmac_group(p + GB, tab + (size_t)(g + 1) * GB * 256);
        }
        if (g < G) acc0 += bf16f(s[g]) * tmac_group(p, tab + (size_t)g * GB * 256);
        y[r] = acc0 + acc1;
    }
}

#define TMAC_NB 2 /* groups per column block: 2 x 13 KB of tables */
static void rows_tmac_blk(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                          int r0, int r1, const void *prep) {
    (void)x;
    const float *tab = prep;
    for (int r = r0; r < r1; r++) y[r] = 0.0f;
    for (int g0 = 0; g0 < G; g0 += TMAC_NB) {
        int g1 = g0 + TMAC_NB < G ? g0 + TMAC_NB : G;
        for (int r = r0; r < r1; r++) {
            const uint8_t *p = pk + ((size_t)r * G + g0) * GB;
            const uint16_t *s = sc + (size_t)r * G;
            float acc = y[r];
            for (int g = g0; g < g1; g++, p += GB)
                acc += bf16f(s[g]) * tmac_group(p, tab + (size_t)g * GB * 256);
            y[r] = acc;
        }
    }
}

static void rows_tmac_gather(const uint8_t *pk, const uint16_t *sc, int G, const float *x,
                             float *y, int r0, int r1, const void *prep) {
    (void)x;
    const float *tab = prep;
    const __m512i off = _mm512_setr_epi32(0, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2304,
                                          2560, 2816, 3072, 0, 0, 0);
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = pk + (size_t)r * G * GB;
        const uint16_t *s = sc + (size_t)r * G;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int g = 0;
        for (; g + 1 < G; g += 2, p += 2 * GB) {
            __m512i i0 = _mm512_add_epi32(
                _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0x1FFF, p)), off);
            __m512i i1 = _mm512_add_epi32(
                _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0x1FFF, p + GB)), off);
            __m512 v0 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0x1FFF, i0,
                                                 tab + (size_t)g * GB * 256, 4);
            __m512 v1 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0x1FFF, i1,
                                                 tab + (size_t)(g + 1) * GB * 256, 4);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(bf16f(s[g])), v0, acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(bf16f(s[g + 1])), v1, acc1);
        }
        if (g < G) {
            __m512i i0 = _mm512_add_epi32(
                _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0x1FFF, p)), off);
            __m512 v0 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0x1FFF, i0,
                                                 tab + (size_t)g * GB * 256, 4);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(bf16f(s[g])), v0, acc0);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
}

/* ---------------------------------------------------------------- 5-6: VBMI/BITALG masks */
/* PLUT[b] bit k = (digit k of b == 2)  -> trit +1
 * MLUT[b] bit k = (digit k of b == 0)  -> trit -1      (k = 0..4, any b in 0..255)
 * Each table is four zmm (bytes 0..63, 64..127, 128..191, 192..255): one 256-entry byte lookup
 * = two vpermt2b (7-bit index) + one blend on bit 7 of the byte.
 * DIDX[i]: vpermt2b index that builds, for group i (bytes 13i..13i+12 of a 64-byte load), a
 * vector whose qword q (weights 8q..8q+7) holds P codes of bytes j0, j0+1, j0+2 in bytes 0..2 and
 * M codes of the same bytes in bytes 3..5, j0 = floor(8q/5) (8 weights span at most 3 bytes).
 * BIDXP/BIDXM: vpshufbitqmb bit selectors: weight w = 8q+t reads bit 8*(w/5 - j0) + w%5 (P) or
 * 24 + that (M) of qword q. Result: bit w of the 64-bit mask = trit w is +1 (resp. -1). */
static uint8_t PLUT[256] __attribute__((aligned(64))), MLUT[256] __attribute__((aligned(64)));
static uint8_t DIDX[4][64] __attribute__((aligned(64)));
static uint8_t BIDXP[64] __attribute__((aligned(64))), BIDXM[64] __attribute__((aligned(64)));

static void init_mask_tables(void) {
    for (int b = 0; b < 256; b++) {
        int p = 0, m = 0;
        for (int k = 0; k < 5; k++) {
            int d = digit(b, k);
            p |= (d == 2) << k;
            m |= (d == 0) << k;
        }
        PLUT[b] = (uint8_t)p, MLUT[b] = (uint8_t)m;
    }
    for (int i = 0; i < 4; i++)
        for (int q = 0; q < 8; q++) {
            int j0 = 8 * q / 5;
            for (int t = 0; t < 8; t++) {
                int j = j0 + (t % 3);
                int v = 13 * i + j;
                if (v > 63) v = 63; /* never selected by BIDX */
                DIDX[i][8 * q + t] = (uint8_t)(t < 3 ? v : t < 6 ? 64 + v : 0);
            }
        }
    for (int w = 0; w < 64; w++) {
        int j0 = 8 * (w / 8) / 5;
        BIDXP[w] = (uint8_t)(8 * (w / 5 - j0) + w % 5);
        BIDXM[w] = (uint8_t)(24 + BIDXP[w]);
    }
}

typedef struct {
    __m512i p0, p1, p2, p3, m0, m1, m2, m3, d0, d1, d2, d3, bp, bm;
} mask_consts;

static inline mask_consts mask_load_consts(void) {
    mask_consts c;
    c.p0 = _mm512_load_si512(PLUT), c.p1 = _mm512_load_si512(PLUT + 64);
    c.p2 = _mm512_load_si512(PLUT + 128), c.p3 = _mm512_load_si512(PLUT + 192);
    c.m0 = _mm512_load_si512(MLUT), c.m1 = _mm512_load_si512(MLUT + 64);
    c.m2 = _mm512_load_si512(MLUT + 128), c.m3 = _mm512_load_si512(MLUT + 192);
    c.d0 = _mm512_load_si512(DIDX[0]), c.d1 = _mm512_load_si512(DIDX[1]);
    c.d2 = _mm512_load_si512(DIDX[2]), c.d3 = _mm512_load_si512(DIDX[3]);
    c.bp = _mm512_load_si512(BIDXP), c.bm = _mm512_load_si512(BIDXM);
    return c;
}

/* 256-entry byte lookups of the P and M codes of 64 packed bytes. */
static inline void mask_codes(const mask_consts *c, __m512i v, __m512i *P, __m512i *M) {
    __mmask64 hi = _mm512_movepi8_mask(v);
    *P = _mm512_mask_blend_epi8(hi, _mm512_permutex2var_epi8(c->p0, v, c->p1),
                                _mm512_permutex2var_epi8(c->p2, v, c->p3));
    *M = _mm512_mask_blend_epi8(hi, _mm512_permutex2var_epi8(c->m0, v, c->m1),
                                _mm512_permutex2var_epi8(c->m2, v, c->m3));
}

/* Sum of trit*x over one group given its +1 / -1 masks: +1 lanes added on the FADD pipes,
 * -1 lanes subtracted with masked FNMADD (x*1) so the FMA pipes share the work. */
static inline __m512 mask_group(__mmask64 kp, __mmask64 km, const float *xg) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
    __m512 x2 = _mm512_loadu_ps(xg + 32), x3 = _mm512_loadu_ps(xg + 48);
    __m512 a = _mm512_maskz_mov_ps((__mmask16)kp, x0);
    __m512 b = _mm512_maskz_mov_ps((__mmask16)(kp >> 16), x1);
    a = _mm512_mask3_fnmadd_ps(x0, one, a, (__mmask16)km);
    b = _mm512_mask3_fnmadd_ps(x1, one, b, (__mmask16)(km >> 16));
    a = _mm512_mask_add_ps(a, (__mmask16)(kp >> 32), a, x2);
    b = _mm512_mask_add_ps(b, (__mmask16)(kp >> 48), b, x3);
    a = _mm512_mask3_fnmadd_ps(x2, one, a, (__mmask16)(km >> 32));
    b = _mm512_mask3_fnmadd_ps(x3, one, b, (__mmask16)(km >> 48));
    return _mm512_add_ps(a, b);
}

static inline void row_scales(const uint16_t *s, int G, float *sf) {
    int g = 0;
    for (; g + 16 <= G; g += 16)
        _mm512_store_si512(sf + g, _mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(s + g))), 16));
    for (; g < G; g++) sf[g] = bf16f(s[g]);
}

/* ng groups (1..4) starting at p: masked load so nothing past them is read. */
static inline __m512 mask_block(const mask_consts *c, const uint8_t *p, int ng, const float *xg,
                                const float *sf, __m512 acc) {
    __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << (13 * ng)) - 1);
    __m512i v = _mm512_maskz_loadu_epi8(lm, p), P, M;
    mask_codes(c, v, &P, &M);
    const __m512i *d[4] = {&c->d0, &c->d1, &c->d2, &c->d3};
    for (int i = 0; i < ng; i++) {
        __m512i D = _mm512_permutex2var_epi8(P, *d[i], M);
        __mmask64 kp = _mm512_bitshuffle_epi64_mask(D, c->bp);
        __mmask64 km = _mm512_bitshuffle_epi64_mask(D, c->bm);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(sf[i]), mask_group(kp, km, xg + 64 * i), acc);
    }
    return acc;
}

static void rows_mask(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                      int r0, int r1, const void *prep) {
    (void)prep;
    mask_consts c = mask_load_consts();
    float sf[MAXG] __attribute__((aligned(64)));
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = pk + (size_t)r * G * GB;
        row_scales(sc + (size_t)r * G, G, sf);
        __m512 acc = _mm512_setzero_ps();
        int g = 0;
        for (; g + 4 <= G; g += 4) acc = mask_block(&c, p + g * GB, 4, x + 64 * g, sf + g, acc);
        if (g < G) acc = mask_block(&c, p + g * GB, G - g, x + 64 * g, sf + g, acc);
        y[r] = _mm512_reduce_add_ps(acc);
    }
}

/* Two rows at once: the same x vectors feed both rows' masked adds (fewer loads, two
 * independent dependency chains per group). */
static void rows_mask2(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                       int r0, int r1, const void *prep) {
    mask_consts c = mask_load_consts();
    float sf0[MAXG] __attribute__((aligned(64))), sf1[MAXG] __attribute__((aligned(64)));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i *d[4] = {&c.d0, &c.d1, &c.d2, &c.d3};
    int r = r0;
    for (; r + 1 < r1; r += 2) {
        const uint8_t *p = pk + (size_t)r * G * GB, *q = p + (size_t)G * GB;
        row_scales(sc + (size_t)r * G, G, sf0);
        row_scales(sc + (size_t)(r + 1) * G, G, sf1);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int g = 0; g < G; g += 4) {
            int ng = G - g < 4 ? G - g : 4;
            __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << (13 * ng)) - 1);
            __m512i P0, M0, P1, M1;
            mask_codes(&c, _mm512_maskz_loadu_epi8(lm, p + g * GB), &P0, &M0);
            mask_codes(&c, _mm512_maskz_loadu_epi8(lm, q + g * GB), &P1, &M1);
            for (int i = 0; i < ng; i++) {
                const float *xg = x + 64 * (g + i);
                __m512i D0 = _mm512_permutex2var_epi8(P0, *d[i], M0);
                __m512i D1 = _mm512_permutex2var_epi8(P1, *d[i], M1);
                __mmask64 kp0 = _mm512_bitshuffle_epi64_mask(D0, c.bp);
                __mmask64 km0 = _mm512_bitshuffle_epi64_mask(D0, c.bm);
                __mmask64 kp1 = _mm512_bitshuffle_epi64_mask(D1, c.bp);
                __mmask64 km1 = _mm512_bitshuffle_epi64_mask(D1, c.bm);
                __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
                for (int k = 0; k < 4; k++) {
                    __m512 xv = _mm512_loadu_ps(xg + 16 * k);
                    a = _mm512_mask_add_ps(a, (__mmask16)(kp0 >> (16 * k)), a, xv);
                    b = _mm512_mask_add_ps(b, (__mmask16)(kp1 >> (16 * k)), b, xv);
                    a = _mm512_mask3_fnmadd_ps(xv, one, a, (__mmask16)(km0 >> (16 * k)));
                    b = _mm512_mask3_fnmadd_ps(xv, one, b, (__mmask16)(km1 >> (16 * k)));
                }
                acc0 = _mm512_fmadd_ps(_mm512_set1_ps(sf0[g + i]), a, acc0);
                acc1 = _mm512_fmadd_ps(_mm512_set1_ps(sf1[g + i]), b, acc1);
            }
        }
        y[r] = _mm512_reduce_add_ps(acc0);
        y[r + 1] = _mm512_reduce_add_ps(acc1);
    }
    if (r < r1) rows_mask(pk, sc, G, x, y, r, r1, prep);
}

/* ---------------------------------------------------------------- 7: transposed T-MAC */
/* 16 rows in the 16 fp32 lanes of a zmm, tables in registers.
 * A packed byte b (5 trits) is split as lo = b mod 9 (trits 0,1) and hi = floor(b/9) (trits
 * 2,3,4). Per 5-input chunk (g, j) the prep builds two small fp32 tables (48 floats, 192 B):
 *   Tlo[16]: Tlo[d0 + 3 d1] = (d0-1) x0 + (d1-1) x1                  (entries 9..15 unused)
 *   Thi[32]: Thi[d2 + 3 d3 + 9 d4] = (d2-1) x2 + (d3-1) x3 + (d4-1) x4  (x4 = 0 for j = 12:
 *            digit 4 of byte 12 is ignored); Thi[27], Thi[28] = Thi[0], Thi[1] because bytes
 *            243..255 have hi = 27, 28 and the same digits 0..4 as b - 243 (243 = 3^5);
 *            b mod 9 = (b - 243) mod 9 since 9 | 243.
 * One vpermps (16-entry table, index bits 3:0) plus one vpermi2ps (32 entries, bits 4:0) then
 * give 16 rows' contributions of 5 weights each: 4 vector ops per 80 weights instead of the ~8
 * masked adds of the mask variant, and x is never loaded per row.
 * Getting 16 rows' byte j into dword lanes: load 52 bytes (4 groups) of 16 rows, transpose
 * 16x16 bytes inside each 128-bit lane with 4 unpack stages (64 ops per 64 row-groups), then
 * register k lane l holds column 16l+k with rows in 4-bit bit-reversed order (0,8,4,12,...).
 * lo/hi byte lookups (256-entry, vpermt2b x2 + blend) run on those 16 registers; one vpermb per
 * column spreads the 16 bytes into dword lanes (byte 0 of dword i = row i; vpermps/vpermi2ps
 * ignore the upper index bits, so the other bytes may hold anything). */
static uint8_t LO9[256] __attribute__((aligned(64))), HI9[256] __attribute__((aligned(64)));
static uint8_t SPREAD[4][64] __attribute__((aligned(64)));

static void init_t16_tables(void) {
    for (int b = 0; b < 256; b++) LO9[b] = (uint8_t)(b % 9), HI9[b] = (uint8_t)(b / 9);
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 16; i++) {
            int rev = ((i & 1) << 3) | ((i & 2) << 1) | ((i & 4) >> 1) | ((i & 8) >> 3);
            for (int t = 0; t < 4; t++) SPREAD[l][4 * i + t] = (uint8_t)(16 * l + rev);
        }
}

static void prep_t16(const float *x, int G, void *buf, int g0, int g1) {
    (void)G;
    float *tab = buf;
    for (int g = g0; g < g1; g++)
        for (int j = 0; j < GB; j++) {
            const float *xx = x + 64 * g + 5 * j;
            float x4 = j == 12 ? 0.0f : xx[4];
            float *t = tab + ((size_t)g * GB + j) * 48;
            float a[3] = {-xx[0], 0.0f, xx[0]}, b[3] = {-xx[1], 0.0f, xx[1]};
            float c[3] = {-xx[2], 0.0f, xx[2]}, d[3] = {-xx[3], 0.0f, xx[3]};
            float e[3] = {-x4, 0.0f, x4};
            for (int l = 0; l < 16; l++) t[l] = l < 9 ? a[l % 3] + b[l / 3] : 0.0f;
            for (int h = 0; h < 32; h++) {
                int hh = h < 27 ? h : h < 29 ? h - 27 : 0;
                t[16 + h] = (c[hh % 3] + d[hh / 3 % 3]) + e[hh / 9];
            }
        }
}

static inline void tp16x16(__m512i *X) {
    __m512i Y[16];
    for (int i = 0; i < 8; i++) {
        Y[2 * i] = _mm512_unpacklo_epi8(X[i], X[i + 8]);
        Y[2 * i + 1] = _mm512_unpackhi_epi8(X[i], X[i + 8]);
    }
    for (int i = 0; i < 8; i++) {
        X[2 * i] = _mm512_unpacklo_epi16(Y[i], Y[i + 8]);
        X[2 * i + 1] = _mm512_unpackhi_epi16(Y[i], Y[i + 8]);
    }
    for (int i = 0; i < 8; i++) {
        Y[2 * i] = _mm512_unpacklo_epi32(X[i], X[i + 8]);
        Y[2 * i + 1] = _mm512_unpackhi_epi32(X[i], X[i + 8]);
    }
    for (int i = 0; i < 8; i++) {
        X[2 * i] = _mm512_unpacklo_epi64(Y[i], Y[i + 8]);
        X[2 * i + 1] = _mm512_unpackhi_epi64(Y[i], Y[i + 8]);
    }
}

static void rows_t16(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                     int r0, int r1, const void *prep) {
    const float *tab = prep;
    const __m512i lo0 = _mm512_load_si512(LO9), lo1 = _mm512_load_si512(LO9 + 64);
    const __m512i lo2 = _mm512_load_si512(LO9 + 128), lo3 = _mm512_load_si512(LO9 + 192);
    const __m512i hi0 = _mm512_load_si512(HI9), hi1 = _mm512_load_si512(HI9 + 64);
    const __m512i hi2 = _mm512_load_si512(HI9 + 128), hi3 = _mm512_load_si512(HI9 + 192);
    const __m512i sp[4] = {_mm512_load_si512(SPREAD[0]), _mm512_load_si512(SPREAD[1]),
                           _mm512_load_si512(SPREAD[2]), _mm512_load_si512(SPREAD[3])};
    float st[MAXG * 16] __attribute__((aligned(64)));
    size_t stride = (size_t)G * GB;
    int r = r0;
    for (; r + 16 <= r1; r += 16) {
        const uint8_t *p = pk + (size_t)r * stride;
        for (int i = 0; i < 16; i++) { /* scales, transposed: st[16g + i] = row i, group g */
            const uint16_t *s = sc + (size_t)(r + i) * G;
            for (int g = 0; g < G; g++) st[16 * g + i] = bf16f(s[g]);
        }
        __m512 acc = _mm512_setzero_ps();
        for (int g0 = 0; g0 < G; g0 += 4) {
            int ng = G - g0 < 4 ? G - g0 : 4, nc = 13 * ng;
            __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
            __m512i X[16];
            for (int i = 0; i < 16; i++)
                X[i] = _mm512_maskz_loadu_epi8(lm, p + i * stride + (size_t)g0 * GB);
#if T16_PREFETCH
            /* The 16 rows are 16 interleaved streams (stride 13G bytes), more than the
             * hardware prefetchers follow well; the next 16-row block is one contiguous
             * 16*13G-byte range, so prefetch it linearly, spread over this block's loop. */
            {
                size_t blk = 16 * stride, per = (blk + 4 * stride / 52 - 1) / ((G + 3) / 4);
                const uint8_t *nb = p + blk + (size_t)(g0 / 4) * per;
                if (r + 32 <= r1)
                    for (size_t o = 0; o < per; o += 64) _mm_prefetch((const char *)nb + o, _MM_HINT_T0);
            }
#endif
            tp16x16(X);
            __m512 S[4], U[4];
            for (int i = 0; i < 4; i++) S[i] = U[i] = _mm512_setzero_ps();
            const float *tg = tab + (size_t)g0 * GB * 48;
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) {
                __mmask64 hb = _mm512_movepi8_mask(X[k]);
                __m512i LO = _mm512_mask_blend_epi8(hb, _mm512_permutex2var_epi8(lo0, X[k], lo1),
                                                    _mm512_permutex2var_epi8(lo2, X[k], lo3));
                __m512i HI = _mm512_mask_blend_epi8(hb, _mm512_permutex2var_epi8(hi0, X[k], hi1),
                                                    _mm512_permutex2var_epi8(hi2, X[k], hi3));
#pragma GCC unroll 4
                for (int l = 0; l < 4; l++) {
                    int c = 16 * l + k; /* column = 13 gi + j */
                    if (c >= nc) continue;
                    int gi = c / 13;
                    const float *t = tg + (size_t)c * 48;
                    __m512i li = _mm512_permutexvar_epi8(sp[l], LO);
                    __m512i hi = _mm512_permutexvar_epi8(sp[l], HI);
                    S[gi] = _mm512_add_ps(S[gi], _mm512_permutexvar_ps(li, _mm512_load_ps(t)));
                    U[gi] = _mm512_add_ps(U[gi], _mm512_permutex2var_ps(_mm512_load_ps(t + 16), hi,
                                                                       _mm512_load_ps(t + 32)));
                }
            }
            for (int gi = 0; gi < ng; gi++)
                acc = _mm512_fmadd_ps(_mm512_load_ps(st + 16 * (g0 + gi)),
                                      _mm512_add_ps(S[gi], U[gi]), acc);
        }
        _mm512_storeu_ps(y + r, acc);
    }
    if (r < r1) rows_mask(pk, sc, G, x, y, r, r1, NULL);
}

/* ---------------------------------------------------------------- 8: t16 with a dword transpose */
/* Variant 7 spends most of its time on the shuffle pipes (Zen 4 runs one 512-bit shuffle per
 * cycle): 64 transpose + 64 lookup + 104 spread + 104 table permutes per 16 rows x 4 groups.
 * Here the 52 bytes of 16 rows are transposed as a 16x16 matrix of *dwords* (4 columns each),
 * so dword lane i of output m holds bytes 4m..4m+3 of row i. vpermps/vpermi2ps read only index
 * bits 3:0 / 4:0, so column 4m+t is indexed by (lo/hi >> 8t): a shift (not a shuffle) replaces
 * the spread vpermb, and the lookups run on 13 registers of 4 columns each instead of 16.
 * Shuffles per block: 64 + 52 + 0 + 104 = 220 instead of 336. Loading the rows in 4-bit
 * bit-reversed order makes the transpose's lanes come out in natural row order; dword column m
 * ends up in register DREG[m] (found by running the network on labelled data). */
static inline void tp16x16_d(__m512i *X) {
    __m512i Y[16];
    for (int i = 0; i < 8; i++) {
        Y[2 * i] = _mm512_unpacklo_epi32(X[i], X[i + 8]);
        Y[2 * i + 1] = _mm512_unpackhi_epi32(X[i], X[i + 8]);
    }
    for (int i = 0; i < 8; i++) {
        X[2 * i] = _mm512_unpacklo_epi64(Y[i], Y[i + 8]);
        X[2 * i + 1] = _mm512_unpackhi_epi64(Y[i], Y[i + 8]);
    }
    for (int i = 0; i < 8; i++) {
        Y[2 * i] = _mm512_shuffle_i32x4(X[i], X[i + 8], 0x88);
        Y[2 * i + 1] = _mm512_shuffle_i32x4(X[i], X[i + 8], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        X[2 * i] = _mm512_shuffle_i32x4(Y[i], Y[i + 8], 0x88);
        X[2 * i + 1] = _mm512_shuffle_i32x4(Y[i], Y[i + 8], 0xDD);
    }
}

static const int BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
/* Output register of tp16x16_d that holds dword column m: 4 (m mod 4) + rev2(m / 4). */
static const int DREG[16] = {0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15};

static void rows_t16d(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                      int r0, int r1, const void *prep) {
    const float *tab = prep;
    const __m512i lo0 = _mm512_load_si512(LO9), lo1 = _mm512_load_si512(LO9 + 64);
    const __m512i lo2 = _mm512_load_si512(LO9 + 128), lo3 = _mm512_load_si512(LO9 + 192);
    const __m512i hi0 = _mm512_load_si512(HI9), hi1 = _mm512_load_si512(HI9 + 64);
    const __m512i hi2 = _mm512_load_si512(HI9 + 128), hi3 = _mm512_load_si512(HI9 + 192);
    float st[MAXG * 16] __attribute__((aligned(64)));
    size_t stride = (size_t)G * GB;
    int r = r0;
    for (; r + 16 <= r1; r += 16) {
        const uint8_t *p = pk + (size_t)r * stride;
#ifndef ABL_NOSCALE
        for (int i = 0; i < 16; i++) {
            const uint16_t *s = sc + (size_t)(r + i) * G;
            for (int g = 0; g < G; g++) st[16 * g + i] = bf16f(s[g]);
        }
#endif
        __m512 acc = _mm512_setzero_ps();
        for (int g0 = 0; g0 < G; g0 += 4) {
            int ng = G - g0 < 4 ? G - g0 : 4, nc = 13 * ng;
            __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
            __m512i X[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                X[i] = _mm512_maskz_loadu_epi8(lm, p + BITREV4[i] * stride + (size_t)g0 * GB);
#if T16_PREFETCH
            {
                size_t blk = 16 * stride, per = (blk + 4 * stride / 52 - 1) / ((G + 3) / 4);
                const uint8_t *nb = p + blk + (size_t)(g0 / 4) * per;
                if (r + 32 <= r1)
                    for (size_t o = 0; o < per; o += 64) _mm_prefetch((const char *)nb + o, _MM_HINT_T0);
            }
#endif
            tp16x16_d(X);
            __m512 S[4], U[4];
            for (int i = 0; i < 4; i++) S[i] = U[i] = _mm512_setzero_ps();
            const float *tg = tab + (size_t)g0 * GB * 48;
#pragma GCC unroll 13
            for (int m = 0; m < 13; m++) {
                if (4 * m >= nc) break;
                __m512i W = X[DREG[m]];
#ifdef ABL_NOLUT
                __m512i LO = W, HI = _mm512_srli_epi32(W, 3);
#else
                __mmask64 hb = _mm512_movepi8_mask(W);
                __m512i LO = _mm512_mask_blend_epi8(hb, _mm512_permutex2var_epi8(lo0, W, lo1),
                                                    _mm512_permutex2var_epi8(lo2, W, lo3));
                __m512i HI = _mm512_mask_blend_epi8(hb, _mm512_permutex2var_epi8(hi0, W, hi1),
                                                    _mm512_permutex2var_epi8(hi2, W, hi3));
#endif
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    int c = 4 * m + t; /* column = 13 gi + j */
                    if (c >= nc) continue;
                    int gi = c / 13;
                    const float *tt = tg + (size_t)c * 48;
                    __m512i li = t ? _mm512_srli_epi32(LO, 8 * t) : LO;
                    __m512i hi = t ? _mm512_srli_epi32(HI, 8 * t) : HI;
                    S[gi] = _mm512_add_ps(S[gi], _mm512_permutexvar_ps(li, _mm512_load_ps(tt)));
                    U[gi] = _mm512_add_ps(U[gi], _mm512_permutex2var_ps(_mm512_load_ps(tt + 16), hi,
                                                                       _mm512_load_ps(tt + 32)));
                }
            }
            for (int gi = 0; gi < ng; gi++)
                acc = _mm512_fmadd_ps(_mm512_load_ps(st + 16 * (g0 + gi)),
                                      _mm512_add_ps(S[gi], U[gi]), acc);
        }
        _mm512_storeu_ps(y + r, acc);
    }
    if (r < r1) rows_mask(pk, sc, G, x, y, r, r1, NULL);
}

/* ---------------------------------------------------------------- 9: t16d, column-blocked */
/* Variant 8 is bound by its table loads: 192 B of tables per column per 16 rows stream from L2
 * (56 groups x 13 x 192 B = 140 KB per input vector), 12x the packed bytes. Here the loops are
 * swapped: for each block of 4 groups (52 columns, 10 KB of tables: L1-resident) sweep all rows
 * of the thread, 16 at a time, accumulating y in memory. Each row's 52-byte piece is read once;
 * the 64-byte lines shared by neighbouring blocks stay in L2 between sweeps (rows x 2 lines =
 * ~200 KB for 1536 rows). Software prefetch pulls the same column range of the rows two
 * 16-row blocks ahead (a strided pattern the hardware prefetchers follow poorly). */
#ifndef T16C_PF_AHEAD
#define T16C_PF_AHEAD 32
#endif
typedef struct {
    __m512i lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3;
} t16_consts;

/* 16 rows (p = row 0, stride bytes apart) x ng groups from group g0: returns sum over the ng
 * groups of scale * (trit . x) per row. sc16 points at 16 transposed fp32 scales per group. */
static inline __m512 t16_block(const t16_consts *k, const uint8_t *p, size_t stride, int g0,
                               int ng, const float *tab, const float *sc16) {
    int nc = 13 * ng;
    __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
    __m512i X[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        X[i] = _mm512_maskz_loadu_epi8(lm, p + BITREV4[i] * stride + (size_t)g0 * GB);
    tp16x16_d(X);
    __m512 S[4], U[4];
    for (int i = 0; i < 4; i++) S[i] = U[i] = _mm512_setzero_ps();
    const float *tg = tab + (size_t)g0 * GB * 48;
#pragma GCC unroll 13
    for (int m = 0; m < 13; m++) {
        if (4 * m >= nc) break;
        __m512i W = X[DREG[m]];
        __mmask64 hb = _mm512_movepi8_mask(W);
        __m512i LO = _mm512_mask_blend_epi8(hb, _mm512_permutex2var_epi8(k->lo0, W, k->lo1),
                                            _mm512_permutex2var_epi8(k->lo2, W, k->lo3));
        __m512i HI = _mm512_mask_blend_epi8(hb, _mm512_permutex2var_epi8(k->hi0, W, k->hi1),
                                            _mm512_permutex2var_epi8(k->hi2, W, k->hi3));
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            int c = 4 * m + t;
            if (c >= nc) continue;
            int gi = c / 13;
            const float *tt = tg + (size_t)c * 48;
            __m512i li = t ? _mm512_srli_epi32(LO, 8 * t) : LO;
            __m512i hi = t ? _mm512_srli_epi32(HI, 8 * t) : HI;
            S[gi] = _mm512_add_ps(S[gi], _mm512_permutexvar_ps(li, _mm512_load_ps(tt)));
            U[gi] = _mm512_add_ps(U[gi], _mm512_permutex2var_ps(_mm512_load_ps(tt + 16), hi,
                                                               _mm512_load_ps(tt + 32)));
        }
    }
    __m512 acc = _mm512_mul_ps(_mm512_load_ps(sc16), _mm512_add_ps(S[0], U[0]));
    for (int gi = 1; gi < ng; gi++)
        acc = _mm512_fmadd_ps(_mm512_load_ps(sc16 + 16 * gi), _mm512_add_ps(S[gi], U[gi]), acc);
    return acc;
}

static void rows_t16c(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                      int r0, int r1, const void *prep) {
    const float *tab = prep;
    t16_consts k = {_mm512_load_si512(LO9),       _mm512_load_si512(LO9 + 64),
                    _mm512_load_si512(LO9 + 128), _mm512_load_si512(LO9 + 192),
                    _mm512_load_si512(HI9),       _mm512_load_si512(HI9 + 64),
                    _mm512_load_si512(HI9 + 128), _mm512_load_si512(HI9 + 192)};
    size_t stride = (size_t)G * GB;
    int r16 = r0 + (r1 - r0) / 16 * 16;
    float st[64] __attribute__((aligned(64)));
    for (int g0 = 0; g0 < G; g0 += 4) {
        int ng = G - g0 < 4 ? G - g0 : 4;
        for (int r = r0; r < r16; r += 16) {
            const uint8_t *p = pk + (size_t)r * stride;
            if (r + T16C_PF_AHEAD + 16 <= r16)
                for (int i = 0; i < 16; i++) {
                    const char *q = (const char *)p + (size_t)(T16C_PF_AHEAD + i) * stride + g0 * GB;
                    _mm_prefetch(q, _MM_HINT_T0);
                    _mm_prefetch(q + 51, _MM_HINT_T0);
                }
            for (int i = 0; i < 16; i++) {
                const uint16_t *s = sc + (size_t)(r + i) * G + g0;
                for (int gi = 0; gi < ng; gi++) st[16 * gi + i] = bf16f(s[gi]);
            }
            __m512 v = t16_block(&k, p, stride, g0, ng, tab, st);
            if (g0) v = _mm512_add_ps(v, _mm512_loadu_ps(y + r));
            _mm512_storeu_ps(y + r, v);
        }
    }
    if (r16 < r1) rows_mask(pk, sc, G, x, y, r16, r1, NULL);
}

/* ---------------------------------------------------------------- 10: t16x (t16d, tuned) */
/* Ablations of variant 8 (micro): without the byte lookups AND the scalar scale transpose it
 * runs 3x faster; each alone gains little: the 8 lookup-table registers plus 16 transposed rows
 * plus 8 accumulators exceed the 32 zmm registers and spill. So:
 *  - lo/hi by arithmetic instead of 256-entry lookups (no table registers, no shuffles):
 *      hi = floor(b/9) = mulhi_u16(b, 7282) on even and odd bytes separately (exact for
 *      b <= 255; 243..255 give 27, 28 as required), lo = b - 9 hi (bytes, no borrow).
 *  - the 16 rows' scales are transposed with the same dword transpose (two groups' bf16 per
 *    dword), not one scalar at a time;
 *  - one accumulator per group (lo and hi lookups added into the same register). */
static inline void t16x_split(__m512i W, __m512i *LO, __m512i *HI) {
    const __m512i m9 = _mm512_set1_epi16(7282), lob = _mm512_set1_epi16(0x00FF);
    __m512i he = _mm512_mulhi_epu16(_mm512_and_si512(W, lob), m9);
    __m512i ho = _mm512_mulhi_epu16(_mm512_srli_epi16(W, 8), m9);
    __m512i hi = _mm512_or_si512(he, _mm512_slli_epi16(ho, 8));
    *HI = hi;
    *LO = _mm512_sub_epi8(_mm512_sub_epi8(W, hi), _mm512_slli_epi16(hi, 3)); /* hi*8 <= 224 */
}

/* st[16g + i] = fp32 scale of row i, group g, for g < G (G <= MAXG). */
static inline void t16x_scales(const uint16_t *sc, int G, float *st) {
    for (int g0 = 0; g0 < G; g0 += 32) {
        int n = G - g0 < 32 ? G - g0 : 32;
        __mmask32 lm = n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1);
        __m512i X[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            X[i] = _mm512_maskz_loadu_epi16(lm, sc + (size_t)BITREV4[i] * G + g0);
        tp16x16_d(X);
        for (int m = 0; 2 * m < n; m++) {
            __m512i v = X[DREG[m]];
            _mm512_store_si512(st + 16 * (g0 + 2 * m), _mm512_slli_epi32(v, 16));
            _mm512_store_si512(st + 16 * (g0 + 2 * m + 1),
                               _mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
        }
    }
}

static inline __m512 t16x_block(const uint8_t *p, size_t stride, int g0, int ng, const float *tab,
                                const float *sc16, __m512 acc) {
    int nc = 13 * ng;
    __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
    __m512i X[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        X[i] = _mm512_maskz_loadu_epi8(lm, p + BITREV4[i] * stride + (size_t)g0 * GB);
#ifndef ABL_NOTP
    tp16x16_d(X);
#endif
    __m512 S[4];
    for (int i = 0; i < 4; i++) S[i] = _mm512_setzero_ps();
    const float *tg = tab + (size_t)g0 * GB * 48;
#pragma GCC unroll 13
    for (int m = 0; m < 13; m++) {
        if (4 * m >= nc) break;
        __m512i LO, HI;
#ifdef ABL_NOSPLIT
        LO = X[DREG[m]], HI = _mm512_ror_epi32(LO, 3);
#else
        t16x_split(X[DREG[m]], &LO, &HI);
#endif
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            int c = 4 * m + t;
            if (c >= nc) continue;
            int gi = c / 13;
            const float *tt = tg + (size_t)c * 48;
#ifdef ABL_NOSHIFT
            __m512i li = LO, hi = HI;
#else
            __m512i li = t ? _mm512_srli_epi32(LO, 8 * t) : LO;
            __m512i hi = t ? _mm512_srli_epi32(HI, 8 * t) : HI;
#endif
            S[gi] = _mm512_add_ps(S[gi], _mm512_permutexvar_ps(li, _mm512_load_ps(tt)));
            S[gi] = _mm512_add_ps(S[gi], _mm512_permutex2var_ps(_mm512_load_ps(tt + 16), hi,
                                                               _mm512_load_ps(tt + 32)));
        }
    }
    for (int gi = 0; gi < ng; gi++)
        acc = _mm512_fmadd_ps(_mm512_load_ps(sc16 + 16 * gi), S[gi], acc);
    return acc;
}

/* Vectorised prep_t16 (same values, same rounding order): per chunk 3 zmm of tables built as
 * x0 c0 + x1 c1 and (x2 c2 + x3 c3) + x4 c4 with constant trit vectors c (entries -1, 0, +1).
 * ~5 us instead of ~33 us per 3584-input vector. */
static float TC[5][48] __attribute__((aligned(64))); /* trit of input k for table entry e */
static void init_t16v_tables(void) {
    for (int e = 0; e < 48; e++) {
        for (int k = 0; k < 5; k++) TC[k][e] = 0.0f;
        if (e < 9) {
            TC[0][e] = (float)(e % 3 - 1), TC[1][e] = (float)(e / 3 - 1);
        } else if (e >= 16 && e < 16 + 29) {
            int h = e - 16, hh = h < 27 ? h : h - 27;
            TC[2][e] = (float)(hh % 3 - 1), TC[3][e] = (float)(hh / 3 % 3 - 1);
            TC[4][e] = (float)(hh / 9 - 1);
        }
    }
}

static void prep_t16v(const float *x, int G, void *buf, int g0, int g1) {
    (void)G;
    float *tab = buf;
    const __m512 c0 = _mm512_load_ps(TC[0]), c1 = _mm512_load_ps(TC[1]);
    const __m512 c2a = _mm512_load_ps(TC[2] + 16), c2b = _mm512_load_ps(TC[2] + 32);
    const __m512 c3a = _mm512_load_ps(TC[3] + 16), c3b = _mm512_load_ps(TC[3] + 32);
    const __m512 c4a = _mm512_load_ps(TC[4] + 16), c4b = _mm512_load_ps(TC[4] + 32);
    for (int g = g0; g < g1; g++)
        for (int j = 0; j < GB; j++) {
            const float *xx = x + 64 * g + 5 * j;
            float *t = tab + ((size_t)g * GB + j) * 48;
            __m512 x0 = _mm512_set1_ps(xx[0]), x1 = _mm512_set1_ps(xx[1]);
            __m512 x2 = _mm512_set1_ps(xx[2]), x3 = _mm512_set1_ps(xx[3]);
            __m512 x4 = _mm512_set1_ps(j == 12 ? 0.0f : xx[4]);
            _mm512_store_ps(t, _mm512_fmadd_ps(x1, c1, _mm512_mul_ps(x0, c0)));
            _mm512_store_ps(t + 16, _mm512_fmadd_ps(x4, c4a, _mm512_fmadd_ps(x3, c3a, _mm512_mul_ps(x2, c2a))));
            _mm512_store_ps(t + 32, _mm512_fmadd_ps(x4, c4b, _mm512_fmadd_ps(x3, c3b, _mm512_mul_ps(x2, c2b))));
        }
}

static void rows_t16x(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                      int r0, int r1, const void *prep) {
    const float *tab = prep;
    float st[MAXG * 16 + 512] __attribute__((aligned(64)));
    size_t stride = (size_t)G * GB;
    /* next 16-row block: one contiguous range of blk bytes, prefetched linearly, `per` bytes
     * per 4-group step of this block (hoisted: a division in the loop cost ~0.6 cycle/group) */
    size_t blk = 16 * stride, per = (blk + (G + 3) / 4 - 1) / ((G + 3) / 4);
    int r = r0;
    for (; r + 16 <= r1; r += 16) {
        const uint8_t *p = pk + (size_t)r * stride;
        t16x_scales(sc + (size_t)r * G, G, st);
        __m512 acc = _mm512_setzero_ps();
        const uint8_t *nb = p + blk;
        int pf = r + 32 <= r1;
        for (int g0 = 0; g0 < G; g0 += 4, nb += per) {
            if (pf)
                for (size_t o = 0; o < per; o += 64) _mm_prefetch((const char *)nb + o, _MM_HINT_T0);
            acc = t16x_block(p, stride, g0, G - g0 < 4 ? G - g0 : 4, tab, st + 16 * g0, acc);
        }
        _mm512_storeu_ps(y + r, acc);
    }
    if (r < r1) rows_mask(pk, sc, G, x, y, r, r1, NULL);
}

/* ---------------------------------------------------------------- 11: t16x on 32 rows */
/* Variant 10 still loads 3 zmm of tables per column per 16 rows (2.4 zmm loads per row-group;
 * Zen 4 does one 512-bit load per cycle). Two 16-row blocks share each table load here: block
 * B's lo/hi index vectors are computed first and parked in L1 (26 zmm, 1.7 KB), block A's stay
 * in registers. */
static void rows_t16x2(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                       int r0, int r1, const void *prep) {
    const float *tab = prep;
    float st0[MAXG * 16 + 512] __attribute__((aligned(64)));
    float st1[MAXG * 16 + 512] __attribute__((aligned(64)));
    __m512i LB[13], HB[13];
    size_t stride = (size_t)G * GB;
    size_t blk = 32 * stride, per = (blk + (G + 3) / 4 - 1) / ((G + 3) / 4);
    int r = r0;
    for (; r + 32 <= r1; r += 32) {
        const uint8_t *pa = pk + (size_t)r * stride, *pb = pa + 16 * stride;
        t16x_scales(sc + (size_t)r * G, G, st0);
        t16x_scales(sc + (size_t)(r + 16) * G, G, st1);
        __m512 acca = _mm512_setzero_ps(), accb = _mm512_setzero_ps();
        const uint8_t *nb = pa + blk;
        int pf = r + 64 <= r1;
        for (int g0 = 0; g0 < G; g0 += 4, nb += per) {
            if (pf)
                for (size_t o = 0; o < per; o += 64) _mm_prefetch((const char *)nb + o, _MM_HINT_T0);
            int ng = G - g0 < 4 ? G - g0 : 4, nc = 13 * ng;
            __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
            __m512i X[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                X[i] = _mm512_maskz_loadu_epi8(lm, pb + BITREV4[i] * stride + (size_t)g0 * GB);
            tp16x16_d(X);
#pragma GCC unroll 13
            for (int m = 0; m < 13; m++) t16x_split(X[DREG[m]], &LB[m], &HB[m]);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                X[i] = _mm512_maskz_loadu_epi8(lm, pa + BITREV4[i] * stride + (size_t)g0 * GB);
            tp16x16_d(X);
            __m512 SA[4], SB[4];
            for (int i = 0; i < 4; i++) SA[i] = SB[i] = _mm512_setzero_ps();
            const float *tg = tab + (size_t)g0 * GB * 48;
#pragma GCC unroll 13
            for (int m = 0; m < 13; m++) {
                if (4 * m >= nc) break;
                __m512i LA, HA;
                t16x_split(X[DREG[m]], &LA, &HA);
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    int c = 4 * m + t;
                    if (c >= nc) continue;
                    int gi = c / 13;
                    const float *tt = tg + (size_t)c * 48;
                    __m512 tl = _mm512_load_ps(tt), ta = _mm512_load_ps(tt + 16);
                    __m512 tb = _mm512_load_ps(tt + 32);
                    __m512i la = t ? _mm512_srli_epi32(LA, 8 * t) : LA;
                    __m512i ha = t ? _mm512_srli_epi32(HA, 8 * t) : HA;
                    __m512i lb = t ? _mm512_srli_epi32(LB[m], 8 * t) : LB[m];
                    __m512i hb = t ? _mm512_srli_epi32(HB[m], 8 * t) : HB[m];
                    SA[gi] = _mm512_add_ps(SA[gi], _mm512_permutexvar_ps(la, tl));
                    SB[gi] = _mm512_add_ps(SB[gi], _mm512_permutexvar_ps(lb, tl));
                    SA[gi] = _mm512_add_ps(SA[gi], _mm512_permutex2var_ps(ta, ha, tb));
                    SB[gi] = _mm512_add_ps(SB[gi], _mm512_permutex2var_ps(ta, hb, tb));
                }
            }
            for (int gi = 0; gi < ng; gi++) {
                acca = _mm512_fmadd_ps(_mm512_load_ps(st0 + 16 * (g0 + gi)), SA[gi], acca);
                accb = _mm512_fmadd_ps(_mm512_load_ps(st1 + 16 * (g0 + gi)), SB[gi], accb);
            }
        }
        _mm512_storeu_ps(y + r, acca);
        _mm512_storeu_ps(y + r + 16, accb);
    }
    if (r < r1) rows_t16x(pk, sc, G, x, y, r, r1, prep);
}

/* ---------------------------------------------------------------- 12: t16f (winner) */
/* Variant 10 with the latency chain removed. Ablations showed variant 10 at ~5.9 cycles per
 * row-group even without transposes, splits and shifts: its per-group accumulator S[g] takes 26
 * dependent adds per 4-group block, and the 4 groups' chains are ~100 instructions apart, too
 * far for the scheduler to overlap, so the block ran at add latency (104 x 3 cycles / 64
 * row-groups ~ 4.9 cycles). Here every lookup is multiplied by its group's 16 row scales and
 * FMA'd into one of 8 rotating accumulators: chains of 13 FMAs per block, no per-group sums. */
static inline void t16f_block(const uint8_t *p, size_t stride, int g0, int ng, const float *tab,
                              const float *sc16, __m512 *acc) {
    int nc = 13 * ng;
    __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
    __m512i X[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        X[i] = _mm512_maskz_loadu_epi8(lm, p + BITREV4[i] * stride + (size_t)g0 * GB);
    tp16x16_d(X);
    __m512 s4[4];
    for (int gi = 0; gi < 4; gi++) s4[gi] = _mm512_load_ps(sc16 + 16 * gi);
    const float *tg = tab + (size_t)g0 * GB * 48;
#pragma GCC unroll 13
    for (int m = 0; m < 13; m++) {
        if (4 * m >= nc) break;
        __m512i LO, HI;
        t16x_split(X[DREG[m]], &LO, &HI);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            int c = 4 * m + t;
            if (c >= nc) continue;
            int gi = c / 13;
            const float *tt = tg + (size_t)c * 48;
            __m512i li = t ? _mm512_srli_epi32(LO, 8 * t) : LO;
            __m512i hi = t ? _mm512_srli_epi32(HI, 8 * t) : HI;
            acc[(2 * c) & 7] = _mm512_fmadd_ps(s4[gi], _mm512_permutexvar_ps(li, _mm512_load_ps(tt)),
                                               acc[(2 * c) & 7]);
            acc[(2 * c + 1) & 7] = _mm512_fmadd_ps(
                s4[gi], _mm512_permutex2var_ps(_mm512_load_ps(tt + 16), hi, _mm512_load_ps(tt + 32)),
                acc[(2 * c + 1) & 7]);
        }
    }
}

static void rows_t16f(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                      int r0, int r1, const void *prep) {
    const float *tab = prep;
    float st[MAXG * 16 + 512] __attribute__((aligned(64)));
    size_t stride = (size_t)G * GB;
    size_t blk = 16 * stride, per = (blk + (G + 3) / 4 - 1) / ((G + 3) / 4);
    int r = r0;
    for (; r + 16 <= r1; r += 16) {
        const uint8_t *p = pk + (size_t)r * stride;
#if T16F_PF_SCALES
        /* the scales stream too (16 rows x 2G bytes per block, read once at block start) */
        if (r + 16 * (T16F_PF_DIST + 1) <= r1) {
            const char *ns = (const char *)(sc + (size_t)(r + 16 * T16F_PF_DIST) * G);
            for (size_t o = 0; o < (size_t)32 * G; o += 64) _mm_prefetch(ns + o, _MM_HINT_T0);
        }
#endif
        t16x_scales(sc + (size_t)r * G, G, st);
        __m512 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
        /* software prefetch of the 16-row block T16F_PF_DIST blocks ahead (one contiguous
         * range), spread evenly over this block's 4-group steps; scales stream on their own */
        const uint8_t *nb = p + T16F_PF_DIST * blk;
        int pf = r + 16 * (T16F_PF_DIST + 1) <= r1;
        for (int g0 = 0; g0 < G; g0 += 4, nb += per) {
            if (pf)
                for (size_t o = 0; o < per; o += 64) _mm_prefetch((const char *)nb + o, T16F_PF_HINT);
            t16f_block(p, stride, g0, G - g0 < 4 ? G - g0 : 4, tab, st + 16 * g0, acc);
        }
        __m512 a = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
                                 _mm512_add_ps(_mm512_add_ps(acc[4], acc[5]), _mm512_add_ps(acc[6], acc[7])));
        _mm512_storeu_ps(y + r, a);
    }
    if (r < r1) rows_mask(pk, sc, G, x, y, r, r1, NULL);
}

/* ---------------------------------------------------------------- 13: t16f, self-contained */
/* Variant 12 with the signature of t158.c's row functions: each call builds its own tables
 * for x in a per-thread buffer (1.6 us per 3584 inputs, ~5 us per expert per thread) instead
 * of a shared prep phase. This is the form to port. */
static void rows_t16f_self(const uint8_t *pk, const uint16_t *sc, int G, const float *x,
                           float *y, int r0, int r1, const void *prep) {
    (void)prep;
    static __thread float *tab;
    static __thread size_t cap;
    size_t need = (size_t)G * GB * 48;
    if (r1 - r0 < 16) {
        rows_mask(pk, sc, G, x, y, r0, r1, NULL);
        return;
    }
    if (need > cap) {
        free(tab);
        tab = aligned_alloc(64, need * 4);
        cap = need;
    }
    prep_t16v(x, G, tab, 0, G);
    rows_t16f(pk, sc, G, x, y, r0, r1, tab);
}

/* ---------------------------------------------------------------- 12n: t16f for n tokens */
/* Multi-token form of variant 12: the byte work (load, transpose, split, shifts) is done once
 * per 16 rows x 4 groups and reused for n tokens; each token has its own tables (prep once per
 * token, tabs[t]) and two accumulators (lo / hi lookups). y is [n, rows] row-major. */
#define T16N_MAX 8
static void rows_t16f_n(const uint8_t *pk, const uint16_t *sc, int G, int n, float *const *tabs,
                        float *y, int ldy, int r0, int r1) {
    float st[MAXG * 16 + 512] __attribute__((aligned(64)));
    size_t stride = (size_t)G * GB;
    size_t blk = 16 * stride, per = (blk + (G + 3) / 4 - 1) / ((G + 3) / 4);
    for (int r = r0; r + 16 <= r1; r += 16) {
        const uint8_t *p = pk + (size_t)r * stride;
        t16x_scales(sc + (size_t)r * G, G, st);
        __m512 A[T16N_MAX], B[T16N_MAX];
        for (int t = 0; t < n; t++) A[t] = B[t] = _mm512_setzero_ps();
        const uint8_t *nb = p + blk;
        int pf = r + 32 <= r1;
        for (int g0 = 0; g0 < G; g0 += 4, nb += per) {
            if (pf)
                for (size_t o = 0; o < per; o += 64) _mm_prefetch((const char *)nb + o, _MM_HINT_T0);
            int ng = G - g0 < 4 ? G - g0 : 4, nc = 13 * ng;
            __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
            __m512i X[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                X[i] = _mm512_maskz_loadu_epi8(lm, p + BITREV4[i] * stride + (size_t)g0 * GB);
            tp16x16_d(X);
            for (int m = 0; m < 13; m++) {
                if (4 * m >= nc) break;
                __m512i LO, HI;
                t16x_split(X[DREG[m]], &LO, &HI);
                for (int q = 0; q < 4; q++) {
                    int c = 4 * m + q;
                    if (c >= nc) break;
                    __m512 s16 = _mm512_load_ps(st + 16 * (g0 + c / 13));
                    __m512i li = _mm512_srlv_epi32(LO, _mm512_set1_epi32(8 * q));
                    __m512i hi = _mm512_srlv_epi32(HI, _mm512_set1_epi32(8 * q));
                    size_t off = ((size_t)g0 * GB + c) * 48;
                    for (int t = 0; t < n; t++) {
                        const float *tt = tabs[t] + off;
                        A[t] = _mm512_fmadd_ps(s16, _mm512_permutexvar_ps(li, _mm512_load_ps(tt)), A[t]);
                        B[t] = _mm512_fmadd_ps(s16, _mm512_permutex2var_ps(_mm512_load_ps(tt + 16), hi,
                                                                           _mm512_load_ps(tt + 32)), B[t]);
                    }
                }
            }
        }
        for (int t = 0; t < n; t++) _mm512_storeu_ps(y + (size_t)t * ldy + r, _mm512_add_ps(A[t], B[t]));
    }
}

/* ---------------------------------------------------------------- variants table */
typedef struct {
    const char *name;
    rows_fn rows;
    prep_fn prep; /* NULL: none */
} variant_t;

static const variant_t VARIANTS[] = {
    {"0 scalar", rows_scalar, NULL},          {"1 avx512", rows_avx512, NULL},
    {"2 tmac", rows_tmac, prep_tmac},         {"3 tmac-blk", rows_tmac_blk, prep_tmac},
    {"4 tmac-gth", rows_tmac_gather, prep_tmac}, {"5 mask", rows_mask, NULL},
    {"6 mask2", rows_mask2, NULL},            {"7 t16", rows_t16, prep_t16},
    {"8 t16d", rows_t16d, prep_t16},          {"9 t16c", rows_t16c, prep_t16},
    {"10 t16x", rows_t16x, prep_t16v},        {"11 t16x2", rows_t16x2, prep_t16v},
    {"12 t16f", rows_t16f, prep_t16v},        {"13 t16f-self", rows_t16f_self, NULL},
};
#define NV ((int)(sizeof VARIANTS / sizeof VARIANTS[0]))

/* ---------------------------------------------------------------- tiny spin pool */
/* Persistent workers released by a generation counter: a fork/join costs ~1 us instead of the
 * ~30-60 us of pthread_create per call, which matters at a ~0.5 ms expert. */
typedef void (*job_fn)(int tid, int nt, void *arg);
static struct {
    atomic_int gen, done, quit;
    job_fn fn;
    void *arg;
    int nt;
} pool;

static void *worker(void *a) {
    int tid = (int)(intptr_t)a, seen = 0;
    for (;;) {
        int g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool.gen, memory_order_acquire)) == seen) {
            if (atomic_load(&pool.quit)) return NULL;
            if (++spins > 20000) sched_yield(); /* other processes share the 2 vCPUs */
            else _mm_pause();
        }
        seen = g;
        pool.fn(tid, pool.nt, pool.arg);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void pool_run(job_fn fn, void *arg) {
    if (pool.nt <= 1) {
        fn(0, 1, arg);
        return;
    }
    pool.fn = fn, pool.arg = arg;
    atomic_store(&pool.done, 0);
    atomic_fetch_add_explicit(&pool.gen, 1, memory_order_release);
    fn(0, pool.nt, arg);
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < pool.nt - 1;)
        if (++spins > 20000) sched_yield();
        else _mm_pause();
}

static pthread_t pool_tid[16];
static void pool_start(int nt) {
    pool.nt = nt;
    atomic_store(&pool.quit, 0);
    for (int t = 1; t < nt; t++) pthread_create(&pool_tid[t], NULL, worker, (void *)(intptr_t)t);
}
static void pool_stop(void) {
    atomic_store(&pool.quit, 1);
    for (int t = 1; t < pool.nt; t++) pthread_join(pool_tid[t], NULL);
    pool.nt = 1;
}

/* ---------------------------------------------------------------- expert harness */
typedef struct {
    uint8_t *pk;
    uint16_t *sc;
    int rows, G;
} mat_t;
typedef struct {
    mat_t gate, up, down;
} expert_t;

#define R_DIM 3584
#define I_DIM 3072

typedef struct {
    const variant_t *v;
    const expert_t *e;
    const float *x; /* padded R */
    float *g, *u;   /* I */
    float *h;       /* padded I */
    float *out;     /* R */
    void *tab;      /* prep buffer */
    int phase;
} job_t;

static void split(int rows, int tid, int nt, int *r0, int *r1) {
    int chunk = (rows + nt - 1) / nt;
    chunk += chunk & 1; /* two-row kernels keep pairs within a thread */
    *r0 = tid * chunk < rows ? tid * chunk : rows;
    *r1 = (tid + 1) * chunk < rows ? (tid + 1) * chunk : rows;
}

static void expert_job(int tid, int nt, void *arg) {
    job_t *j = arg;
    const variant_t *v = j->v;
    int r0, r1;
    switch (j->phase) {
    case 0: /* prep(x) */
        split(R_DIM / GE, tid, nt, &r0, &r1);
        v->prep(j->x, R_DIM / GE, j->tab, r0, r1);
        break;
    case 1: /* gate + up rows, then the activation of those rows (same thread: no barrier) */
        split(I_DIM, tid, nt, &r0, &r1);
        v->rows(j->e->gate.pk, j->e->gate.sc, j->e->gate.G, j->x, j->g, r0, r1, j->tab);
        v->rows(j->e->up.pk, j->e->up.sc, j->e->up.G, j->x, j->u, r0, r1, j->tab);
        for (int i = r0; i < r1; i++) {
            const float beta = 10.0f, beta_lin = 10.0f;
            float g = j->g[i], u = j->u[i];
            float sig = 1.0f / (1.0f + expf(-g));
            j->h[i] = beta * tanhf(g / beta) * sig * (beta_lin * tanhf(u / beta_lin));
        }
        break;
    case 2: /* prep(h) */
        split(I_DIM / GE, tid, nt, &r0, &r1);
        v->prep(j->h, I_DIM / GE, j->tab, r0, r1);
        break;
    case 3:
        split(R_DIM, tid, nt, &r0, &r1);
        v->rows(j->e->down.pk, j->e->down.sc, j->e->down.G, j->h, j->out, r0, r1, j->tab);
        break;
    }
}

static void run_expert(job_t *j) {
    for (int ph = 0; ph < 4; ph++) {
        if ((ph == 0 || ph == 2) && !j->v->prep) continue;
        j->phase = ph;
        pool_run(expert_job, j);
    }
}

/* Plain GEMV through the pool (validation). */
typedef struct {
    const variant_t *v;
    const mat_t *m;
    const float *x;
    float *y;
    void *tab;
    int phase;
} gemv_job_t;

static void gemv_job(int tid, int nt, void *arg) {
    gemv_job_t *j = arg;
    int r0, r1;
    if (j->phase == 0) {
        split(j->m->G, tid, nt, &r0, &r1);
        j->v->prep(j->x, j->m->G, j->tab, r0, r1);
    } else {
        split(j->m->rows, tid, nt, &r0, &r1);
        j->v->rows(j->m->pk, j->m->sc, j->m->G, j->x, j->y, r0, r1, j->tab);
    }
}

static void run_gemv(const variant_t *v, const mat_t *m, const float *x, float *y, void *tab) {
    gemv_job_t j = {v, m, x, y, tab, 0};
    if (v->prep) pool_run(gemv_job, &j);
    j.phase = 1;
    pool_run(gemv_job, &j);
}

/* Double-precision reference straight from the FORMAT.md formula. */
static void ref_gemv(const mat_t *m, const float *x, double *y) {
    for (int r = 0; r < m->rows; r++) {
        const uint8_t *p = m->pk + (size_t)r * m->G * GB;
        double acc = 0;
        for (int g = 0; g < m->G; g++) {
            double sum = 0;
            for (int i = 0; i < 64; i++) {
                int b = p[13 * g + i / 5];
                sum += (double)(digit(b, i % 5) - 1) * x[64 * g + i];
            }
            acc += (double)bf16f(m->sc[(size_t)r * m->G + g]) * sum;
        }
        y[r] = acc;
    }
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return rng_state;
}
static float rndf(void) { return (float)((rnd() >> 11) * (1.0 / 9007199254740992.0) * 2 - 1); }

static float *falloc(size_t n) {
    float *p = aligned_alloc(64, (n * 4 + 63) / 64 * 64);
    memset(p, 0, n * 4);
    return p;
}

static void make_mat(mat_t *m, int rows, int cols) {
    m->rows = rows, m->G = cols / GE;
    size_t nb = (size_t)rows * m->G * GB, ns = (size_t)rows * m->G;
#ifdef LAB_HUGE /* experiment: 2 MB pages for the weights (the runtime mmaps 4 KB pages) */
    m->pk = aligned_alloc(1 << 21, (nb + (1 << 21) - 1) >> 21 << 21);
    m->sc = aligned_alloc(1 << 21, (ns * 2 + (1 << 21) - 1) >> 21 << 21);
    madvise(m->pk, (nb + (1 << 21) - 1) >> 21 << 21, MADV_HUGEPAGE);
    madvise(m->sc, (ns * 2 + (1 << 21) - 1) >> 21 << 21, MADV_HUGEPAGE);
#else
    m->pk = aligned_alloc(64, (nb + 63) / 64 * 64);
    m->sc = aligned_alloc(64, (ns * 2 + 63) / 64 * 64);
#endif
    for (size_t i = 0; i < nb; i += 8) {
        uint64_t v = rnd();
        memcpy(m->pk + i, &v, nb - i < 8 ? nb - i : 8);
    }
    for (size_t i = 0; i < ns; i++) { /* bf16 of a positive scale in ~[0.004, 0.03] */
        float f = 0.004f + 0.026f * (float)(rnd() >> 40) / (float)(1 << 24);
        uint32_t u;
        memcpy(&u, &f, 4);
        m->sc[i] = (uint16_t)(u >> 16);
    }
}

/* ---------------------------------------------------------------- bandwidth references */
static double copy_bw(void) {
    size_t n = (size_t)1 << 30;
    char *a = malloc(n), *b = malloc(n);
    memset(a, 1, n), memset(b, 2, n);
    double best = 1e9;
    for (int i = 0; i < 5; i++) {
        double t = now();
        memcpy(b, a, n);
        t = now() - t;
        if (t < best) best = t;
    }
    volatile char sink = b[n / 2];
    (void)sink;
    free(a), free(b);
    return 2.0 * n / best;
}

typedef struct {
    const float *a;
    size_t n;
    double s[16];
} read_job_t;
static void read_job(int tid, int nt, void *arg) {
    read_job_t *j = arg;
    size_t c = j->n / nt, i0 = c * tid;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = i0; i < i0 + c; i += 64) {
        s0 = _mm512_add_ps(s0, _mm512_load_ps(j->a + i));
        s1 = _mm512_add_ps(s1, _mm512_load_ps(j->a + i + 16));
        s2 = _mm512_add_ps(s2, _mm512_load_ps(j->a + i + 32));
        s3 = _mm512_add_ps(s3, _mm512_load_ps(j->a + i + 48));
    }
    j->s[tid] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
static double read_bw(int nt) {
    size_t n = (size_t)1 << 28; /* floats: 1 GiB */
    float *a = falloc(n);
    for (size_t i = 0; i < n; i++) a[i] = 1.0f;
    read_job_t j = {a, n, {0}};
    pool_start(nt);
    double best = 1e9;
    for (int i = 0; i < 5; i++) {
        double t = now();
        pool_run(read_job, &j);
        t = now() - t;
        if (t < best) best = t;
    }
    pool_stop();
    free(a);
    return n * 4.0 / best;
}

/* Core clock estimate: a chain of dependent adds retires one per cycle. */
static double clock_ghz(void) {
    uint64_t v = 1;
    long n = 1000000;
    double best = 1e9;
    for (int rep = 0; rep < 50; rep++) { /* best of many short runs: robust to preemption */
        double t = now();
        for (long i = 0; i < n; i++)
            __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(v));
        t = now() - t;
        if (t < best) best = t;
    }
    return 4.0 * n / best / 1e9;
}

/* Cache-resident kernel cost: rows() over a [256, 3584] matrix (~190 KB, L2) repeated; prints
 * core cycles per (row, group) = per 13 packed bytes. Separates compute from DRAM. */
static void micro(int only) {
    double ghz = clock_ghz();
    mat_t m;
    make_mat(&m, 256, R_DIM);
    float *x = falloc(R_DIM + XPAD), *y = falloc(256);
    for (int i = 0; i < R_DIM; i++) x[i] = rndf();
    void *tab = aligned_alloc(64, (size_t)64 * GB * 256 * 4); /* up to 64 groups (odd shape: 57) */
    printf("micro: clock ~%.2f GHz; [256,3584] matrix in L2, 1 thread\n", ghz);
    for (int v = 0; v < NV; v++) {
        if (only >= 0 && v != only) continue;
        const variant_t *vv = &VARIANTS[v];
        if (vv->prep) {
            double tp = 1e9;
            for (int rep = 0; rep < 20; rep++) {
                double t = now();
                vv->prep(x, m.G, tab, 0, m.G);
                t = now() - t;
                if (t < tp) tp = t;
            }
            printf("  %-11s prep(x[3584]) %.1f us\n", vv->name, tp * 1e6);
        }
        double best = 1e9;
        for (int rep = 0; rep < 100; rep++) {
            double t = now();
            for (int k = 0; k < 10; k++) vv->rows(m.pk, m.sc, m.G, x, y, 0, 256, tab);
            t = (now() - t) / 10;
            if (t < best) best = t;
        }
        printf("  %-11s %6.3f ns = %5.2f cycles per row-group (13 bytes) = %.2f bytes/cycle\n",
               vv->name, best * 1e9 / (256.0 * m.G), best * ghz * 1e9 / (256.0 * m.G),
               13.0 * 256 * m.G / (best * ghz * 1e9));
    }
}

/* micro for n tokens: cycles per (row-group, token), and validation against the reference */
static void micro_n(int n) {
    double ghz = clock_ghz();
    mat_t m;
    make_mat(&m, 256, R_DIM);
    float *xs[T16N_MAX], *tabs[T16N_MAX];
    float *y = falloc((size_t)n * 256);
    double *ref = malloc(sizeof(double) * 256);
    for (int t = 0; t < n; t++) {
        xs[t] = falloc(R_DIM + XPAD);
        for (int i = 0; i < R_DIM; i++) xs[t][i] = rndf();
        tabs[t] = aligned_alloc(64, (size_t)(R_DIM / GE) * GB * 48 * 4);
        prep_t16v(xs[t], m.G, tabs[t], 0, m.G);
    }
    double best = 1e9;
    for (int rep = 0; rep < 50; rep++) {
        double t0 = now();
        for (int k = 0; k < 4; k++) rows_t16f_n(m.pk, m.sc, m.G, n, tabs, y, 256, 0, 256);
        t0 = (now() - t0) / 4;
        if (t0 < best) best = t0;
    }
    double worst = 0;
    for (int t = 0; t < n; t++) {
        ref_gemv(&m, xs[t], ref);
        double num = 0, den = 0;
        for (int r = 0; r < 256; r++) {
            double d = y[(size_t)t * 256 + r] - ref[r];
            num += d * d, den += ref[r] * ref[r];
        }
        if (sqrt(num / den) > worst) worst = sqrt(num / den);
    }
    printf("micro n=%d: t16f_n %.3f ns = %.2f cycles per row-group per token (%.2f per row-group "
           "for all %d tokens); worst rel_rms %.2e %s\n",
           n, best * 1e9 / (256.0 * m.G * n), best * ghz * 1e9 / (256.0 * m.G * n),
           best * ghz * 1e9 / (256.0 * m.G), n, worst, worst < 1e-6 ? "ok" : "FAIL");
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "micron")) {
        init_t16_tables();
        init_t16v_tables();
        micro_n(argc > 2 ? atoi(argv[2]) : 8);
        return 0;
    }
    if (argc > 1 && !strcmp(argv[1], "micro")) {
        init_luts();
        init_mask_tables();
        init_t16_tables();
        init_t16v_tables();
        micro(argc > 2 ? atoi(argv[2]) : -1);
        return 0;
    }
    int nexp = argc > 1 ? atoi(argv[1]) : 16;
    int passes = argc > 2 ? atoi(argv[2]) : 7;
    int only = argc > 3 ? atoi(argv[3]) : -1; /* time one variant only */
    init_luts();
    init_mask_tables();
    init_t16_tables();
    init_t16v_tables();
    expert_t *E = malloc(sizeof(expert_t) * nexp);
    for (int e = 0; e < nexp; e++) {
        make_mat(&E[e].gate, I_DIM, R_DIM);
        make_mat(&E[e].up, I_DIM, R_DIM);
        make_mat(&E[e].down, R_DIM, I_DIM);
    }
    size_t ebytes = 0;
    const mat_t *ms[3] = {&E[0].gate, &E[0].up, &E[0].down};
    for (int i = 0; i < 3; i++) ebytes += (size_t)ms[i]->rows * ms[i]->G * (GB + 2);
    float *x = falloc(R_DIM + XPAD), *g = falloc(I_DIM), *u = falloc(I_DIM);
    float *h = falloc(I_DIM + XPAD), *out = falloc(R_DIM + XPAD);
    for (int i = 0; i < R_DIM; i++) x[i] = rndf();
    void *tab = aligned_alloc(64, (size_t)64 * GB * 256 * 4); /* up to 64 groups (odd shape: 57) */

    /* validation: both shapes, 1 and 2 threads, against the double reference */
    double *ref = malloc(sizeof(double) * R_DIM);
    float *y = falloc(R_DIM + XPAD);
    float *hx = falloc(I_DIM + XPAD);
    for (int i = 0; i < I_DIM; i++) hx[i] = rndf();
    printf("validation (relative RMS vs double reference; all byte values 0..255):\n");
    mat_t odd; /* G = 57 (not a multiple of 4), 1000 rows (not a multiple of 16) */
    make_mat(&odd, 1000, 3648);
    float *xo = falloc(3648 + XPAD);
    for (int i = 0; i < 3648; i++) xo[i] = rndf();
    for (int m = 0; m < 3; m++) {
        const mat_t *mt = m == 0 ? &E[0].gate : m == 1 ? &E[0].down : &odd;
        const float *xin = m == 0 ? x : m == 1 ? hx : xo;
        ref_gemv(mt, xin, ref);
        for (int v = 0; v < NV; v++)
            for (int nt = 1; nt <= 2; nt++) {
                if (only >= 0 && v != only) continue;
                pool_start(nt);
                memset(y, 0, sizeof(float) * R_DIM);
                run_gemv(&VARIANTS[v], mt, xin, y, tab);
                pool_stop();
                double num = 0, den = 0;
                for (int r = 0; r < mt->rows; r++) {
                    double d = y[r] - ref[r];
                    num += d * d, den += ref[r] * ref[r];
                }
                double rel = sqrt(num / den);
                printf("  %-12s %s threads=%d rel_rms=%.2e %s\n", VARIANTS[v].name,
                       m == 0 ? "gate[3072,3584]" : m == 1 ? "down[3584,3072]" : "odd[1000,3648]", nt, rel,
                       rel < 1e-6 ? "ok" : "FAIL");
            }
    }

    double cbw = copy_bw(), rbw1 = read_bw(1), rbw2 = read_bw(2);
    printf("\nmachine: memcpy 1 GiB (read+write bytes, as bench_kernels' numpy copy) %.2f GB/s; "
           "read-only sum 1 thread %.2f GB/s, 2 threads %.2f GB/s\n",
           cbw / 1e9, rbw1 / 1e9, rbw2 / 1e9);
    printf("expert: gate+up [3072,3584] + down [3584,3072], T=1, %zu packed+scale bytes, "
           "%d experts cycled, best of %d passes\n\n",
           ebytes, nexp, passes);
    printf("%-12s %7s %10s %8s %9s %9s %10s %8s %9s\n", "variant", "threads", "ms/expert", "GB/s",
           "%copy_bw", "%read_bw", "best1_ms", "GB/s", "%copy_bw");
    for (int v = 0; v < NV; v++) {
        if (only >= 0 && v != only) continue;
        for (int nt = 1; nt <= 2; nt++) {
            pool_start(nt);
            job_t j = {&VARIANTS[v], NULL, x, g, u, h, out, tab, 0};
            /* best: best pass (mean over the experts of one pass); best1: fastest single expert
             * call over all passes (each from DRAM: the other experts evict it), which survives
             * a busy machine better; on a quiet machine the two agree within a few percent. */
            double best = 1e9, best1 = 1e9;
            for (int pass = 0; pass <= passes; pass++) {
                double t = now();
                for (int e = 0; e < nexp; e++) {
                    j.e = &E[e];
                    double t1 = now();
                    run_expert(&j);
                    t1 = now() - t1;
                    if (pass > 0 && t1 < best1) best1 = t1;
                }
                t = (now() - t) / nexp;
                if (pass > 0 && t < best) best = t; /* pass 0 warms up */
            }
            pool_stop();
            double gbs = ebytes / best / 1e9, gbs1 = ebytes / best1 / 1e9;
            printf("%-12s %7d %10.3f %8.2f %8.1f%% %8.1f%% %10.3f %8.2f %8.1f%%\n", VARIANTS[v].name, nt,
                   best * 1e3, gbs, 100 * gbs * 1e9 / cbw, 100 * gbs * 1e9 / (nt == 1 ? rbw1 : rbw2),
                   best1 * 1e3, gbs1, 100 * gbs1 * 1e9 / cbw);
            fflush(stdout);
        }
    }
    return 0;
}
