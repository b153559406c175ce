/* t16f: the winning t158 GEMV row kernel of tools/kernel_lab (variant 12/13), self-contained for
 * porting into native/cpu/t158_cpu.c. Needs AVX-512 F/BW/DQ (Zen 4, Ice Lake and later); the
 * target attribute below lets it sit in a file compiled without -march=native.
 *
 *   t16f_rows(packed, scales, G, x, y, r0, r1)   same contract as t158_cpu.c's rows_* functions:
 *     y[r] = sum_g bf16(scales[r,g]) * sum_i trit(r,g,i) * x[64g+i]   for r in [r0, r1)
 *   x needs no padding (reads x[0 .. 64G-1] only).
 *
 * Idea (README.md): 16 rows sit in the 16 fp32 lanes. A packed byte b (5 trits) is split into
 * lo = b mod 9 (trits 0,1) and hi = floor(b/9) (trits 2,3,4). Per 5-input chunk (group g, byte j)
 * two fp32 tables hold every partial dot product: Tlo[16] (9 used) and Thi[32] (27 used, plus
 * copies at 27 and 28 for bytes 243..255). vpermps / vpermi2ps then look up 16 rows at once.
 * The rows' bytes are transposed 16 x 16 dwords at a time, so dword lane i holds 4 columns of
 * row i, and column t is indexed by (lo >> 8t). The permutes read only index bits 3:0 / 4:0.
 * The per-call table build costs ~1.6 us per 3584 inputs (48 floats per chunk, 140 KB).
 * Rows are done 16 at a time. Give each thread a multiple of 16 rows; a tail of < 16 rows goes
 * to the scalar fallback passed in (the port should hand in its existing avx512 path).
 */
#ifndef T16F_PORT_H
#define T16F_PORT_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define T16F_TGT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

typedef void (*t16f_tail_fn)(const uint8_t *, const uint16_t *, int, const float *, float *, int,
                             int);

static const int T16F_BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
/* register of t16f_tp16 output that holds dword column m (found by running it on labels) */
static const int T16F_DREG[16] = {0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15};

/* trit of input k (0..4) for table entry e (0..47: Tlo at 0..15, Thi at 16..47) */
static float T16F_TC[5][48] __attribute__((aligned(64)));
static void t16f_init(void) { /* call once (pthread_once) before use */
    for (int e = 0; e < 48; e++) {
        for (int k = 0; k < 5; k++) T16F_TC[k][e] = 0.0f;
        if (e < 9) {
            T16F_TC[0][e] = (float)(e % 3 - 1), T16F_TC[1][e] = (float)(e / 3 - 1);
        } else if (e >= 16 && e < 16 + 29) {
            int h = e - 16, hh = h < 27 ? h : h - 27; /* 243..255 -> hi 27, 28 = b - 243 */
            T16F_TC[2][e] = (float)(hh % 3 - 1), T16F_TC[3][e] = (float)(hh / 3 % 3 - 1);
            T16F_TC[4][e] = (float)(hh / 9 - 1);
        }
    }
}

/* tab[(13g + j) * 48 + e]: Tlo (e < 16) and Thi (16 <= e < 48) of chunk (g, j), g < G. */
T16F_TGT static void t16f_tables(const float *x, int G, float *tab) {
    const __m512 c0 = _mm512_load_ps(T16F_TC[0]), c1 = _mm512_load_ps(T16F_TC[1]);
    const __m512 c2a = _mm512_load_ps(T16F_TC[2] + 16), c2b = _mm512_load_ps(T16F_TC[2] + 32);
    const __m512 c3a = _mm512_load_ps(T16F_TC[3] + 16), c3b = _mm512_load_ps(T16F_TC[3] + 32);
    const __m512 c4a = _mm512_load_ps(T16F_TC[4] + 16), c4b = _mm512_load_ps(T16F_TC[4] + 32);
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 13; j++) {
            const float *xx = x + 64 * g + 5 * j;
            float *t = tab + ((size_t)g * 13 + j) * 48;
            __m512 x0 = _mm512_set1_ps(xx[0]), x1 = _mm512_set1_ps(xx[1]);
            __m512 x2 = _mm512_set1_ps(xx[2]), x3 = _mm512_set1_ps(xx[3]);
            __m512 x4 = _mm512_set1_ps(j == 12 ? 0.0f : xx[4]); /* digit 4 of byte 12 ignored */
            _mm512_store_ps(t, _mm512_fmadd_ps(x1, c1, _mm512_mul_ps(x0, c0)));
            _mm512_store_ps(t + 16, _mm512_fmadd_ps(x4, c4a, _mm512_fmadd_ps(x3, c3a, _mm512_mul_ps(x2, c2a))));
            _mm512_store_ps(t + 32, _mm512_fmadd_ps(x4, c4b, _mm512_fmadd_ps(x3, c3b, _mm512_mul_ps(x2, c2b))));
        }
}

/* 16x16 dword transpose; with rows loaded in bit-reversed order the lanes come out in row
 * order and dword column m lands in register T16F_DREG[m]. */
T16F_TGT static inline void t16f_tp16(__m512i *X) {
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

/* bytes b -> lo = b mod 9, hi = floor(b/9) (exact for 0..255: 7282 = ceil(65536/9)) */
T16F_TGT static inline void t16f_split(__m512i W, __m512i *LO, __m512i *HI) {
    const __m512i m9 = _mm512_set1_epi16(7282), lob = _mm512_set1_epi16(0x00FF);
    __m512i he = _mm512_mulhi_epu16(_mm512_and_si512(W, lob), m9);
    __m512i ho = _mm512_mulhi_epu16(_mm512_srli_epi16(W, 8), m9);
    __m512i hi = _mm512_or_si512(he, _mm512_slli_epi16(ho, 8));
    *HI = hi;
    *LO = _mm512_sub_epi8(_mm512_sub_epi8(W, hi), _mm512_slli_epi16(hi, 3)); /* b - 9 hi */
}

/* st[16g + i] = fp32 scale of row i (of 16), group g < G; st has room for 16*(G rounded to 32) */
T16F_TGT static inline void t16f_scales(const uint16_t *sc, int G, float *st) {
    for (int g0 = 0; g0 < G; g0 += 32) {
        int n = G - g0 < 32 ? G - g0 : 32;
        __mmask32 lm = n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1);
        __m512i X[16];
        for (int i = 0; i < 16; i++)
            X[i] = _mm512_maskz_loadu_epi16(lm, sc + (size_t)T16F_BITREV4[i] * G + g0);
        t16f_tp16(X);
        for (int m = 0; 2 * m < n; m++) { /* dword = scales of groups 2m, 2m+1 */
            __m512i v = X[T16F_DREG[m]];
            _mm512_store_si512(st + 16 * (g0 + 2 * m), _mm512_slli_epi32(v, 16));
            _mm512_store_si512(st + 16 * (g0 + 2 * m + 1),
                               _mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
        }
    }
}

/* 16 rows x ng (1..4) groups from g0; FMA into 8 rotating accumulators (short chains). */
T16F_TGT static inline void t16f_block16(const uint8_t *p, size_t stride, int g0, int ng,
                                       const float *tab, const float *sc16, __m512 *acc) {
    int nc = 13 * ng;
    __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
    __m512i X[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        X[i] = _mm512_maskz_loadu_epi8(lm, p + T16F_BITREV4[i] * stride + (size_t)g0 * 13);
    t16f_tp16(X);
    __m512 s4[4];
    for (int gi = 0; gi < 4; gi++) s4[gi] = _mm512_load_ps(sc16 + 16 * gi);
    const float *tg = tab + (size_t)g0 * 13 * 48;
#pragma GCC unroll 13
    for (int m = 0; m < 13; m++) {
        if (4 * m >= nc) break;
        __m512i LO, HI;
        t16f_split(X[T16F_DREG[m]], &LO, &HI);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            int c = 4 * m + t; /* column c = byte j of group gi: c = 13 gi + j */
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

/* Rows [r0, r1) with caller-built tables (t16f_tables(x, G, tab), shareable by all threads and
 * by gate and up). G <= 1024. */
T16F_TGT static void t16f_rows_tab(const uint8_t *pk, const uint16_t *sc, int G, const float *x,
                                   float *y, int r0, int r1, const float *tab, t16f_tail_fn tail) {
    float st[1024 * 16 + 512] __attribute__((aligned(64)));
    size_t stride = (size_t)G * 13;
    /* next 16-row block is one contiguous range: prefetch it evenly over this block's steps
     * (1.9 -> 1.3 ms per expert single-threaded from DRAM in the lab) */
    size_t blk = 16 * stride, per = (blk + (G + 3) / 4 - 1) / ((G + 3) / 4);
    int r = r0;
    for (; r + 16 <= r1; r += 16) {
        const uint8_t *p = pk + (size_t)r * stride;
        t16f_scales(sc + (size_t)r * G, G, st);
        __m512 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
        const uint8_t *nb = p + blk;
        int pf = r + 32 <= r1;
        for (int g0 = 0; g0 < G; g0 += 4, nb += per) {
            if (pf)
                for (size_t o = 0; o < per; o += 64) _mm_prefetch((const char *)nb + o, _MM_HINT_T0);
            t16f_block16(p, stride, g0, G - g0 < 4 ? G - g0 : 4, tab, st + 16 * g0, acc);
        }
        __m512 a = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
                                 _mm512_add_ps(_mm512_add_ps(acc[4], acc[5]), _mm512_add_ps(acc[6], acc[7])));
        _mm512_storeu_ps(y + r, a);
    }
    if (r < r1) tail(pk, sc, G, x, y, r, r1);
}

/* Self-contained form: builds the tables for x in a per-thread buffer on every call. */
T16F_TGT static void t16f_rows(const uint8_t *pk, const uint16_t *sc, int G, const float *x,
                               float *y, int r0, int r1, t16f_tail_fn tail) {
    static __thread float *tab;
    static __thread size_t cap;
    size_t need = (size_t)G * 13 * 48;
    if (r1 - r0 < 16 || G > 1024) {
        tail(pk, sc, G, x, y, r0, r1);
        return;
    }
    if (need > cap) {
        free(tab);
        tab = aligned_alloc(64, need * 4);
        if (!tab) {
            cap = 0;
            tail(pk, sc, G, x, y, r0, r1);
            return;
        }
        cap = need;
    }
    t16f_tables(x, G, tab);
    t16f_rows_tab(pk, sc, G, x, y, r0, r1, tab, tail);
}
#endif
