/* t16f: the t158 GEMV row kernel of t158.c's avx512 path ("transposed T-MAC"), promoted
 * from tools/kernel_lab (variant 12 / t16f_port.h; design and measurements in
 * tools/kernel_lab/README.md). Needs AVX-512 F/BW/DQ only; the target attribute lets it sit in a
 * file compiled without -march flags.
 *
 *   y[r] = sum_g bf16(scale[r,g]) * sum_i trit(r,g,i) * x[64g+i]
 *
 * 16 rows sit in the 16 fp32 lanes. A packed byte b (5 trits) is split into lo = b mod 9 (trits
 * 0,1) and hi = floor(b/9) (trits 2,3,4). Per 5-input chunk (group g, byte j) two fp32 tables
 * hold every partial dot product of x: Tlo[16] (9 used) and Thi[32] (27 used, plus copies at 27
 * and 28, so bytes 243..255 decode as b - 243, the codec's rule). vpermps / vpermi2ps look them
 * up for 16 rows at once; the rows' bytes are transposed 16 x 16 dwords at a time, so dword
 * lane i holds 4 columns of row i. Digit 4 of byte 12 is ignored because that chunk's table has
 * x4 = 0. Tables: t16f_tables(x) once per input vector (48 floats per chunk, T16F_TAB_FLOATS(G)
 * floats, 140 KB at 3584 inputs), read-only afterwards. Two 16-row blocks go through each pass
 * over the groups together, sharing every table read.
 *
 * Every operation is lane-wise, so a row's result does not depend on the block it sits in, nor
 * on the other rows of that block: t16f_span pads the < 32 rows after its last whole 32 to a
 * 32-row block (zero rows, results dropped) and runs the same code, so every row of a matrix
 * goes through the same arithmetic whatever r0, r1 (thread count, row chunking) are. There is
 * no limit on G (the lab's stack buffer, which capped G at 1024, is in the caller's scratch
 * here).
 */
#include "t158_t16f.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static const int T16F_BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
/* register of t16f_tp16 output that holds dword column m (found by running it on labels) */
static const int T16F_DREG[16] = {0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15};

/* trit of input k (0..4) for table entry e (0..47: Tlo at 0..15, Thi at 16..47) */
static float T16F_TC[5][48] __attribute__((aligned(64)));

void t16f_init(void) {
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

/* tab[(13g + j) * 48 + e]: Tlo (e < 16) and Thi (16 <= e < 48) of chunk (g, j), g < G; tab is
 * 64-byte aligned. Reads x[0 .. 64G-1] only. */
T16F_TGT void t16f_tables(const float *x, int G, float *tab) {
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
            _mm512_store_ps(t + 16, _mm512_fmadd_ps(x4, c4a, _mm512_fmadd_ps(
                                                                 x3, c3a, _mm512_mul_ps(x2, c2a))));
            _mm512_store_ps(t + 32, _mm512_fmadd_ps(x4, c4b, _mm512_fmadd_ps(
                                                                 x3, c3b, _mm512_mul_ps(x2, c2b))));
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

/* st[16g + i] = fp32 scale of row i (of the 16 at sc, row stride G), group g < G. Writes up to
 * st[16 * (G rounded up to 2)) (T16F_ST_FLOATS(G) floats, 64-byte aligned). */
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

/* 32 rows, blocks a and b of 16 (16 rows in the zmm lanes each), x ng (1..4) groups from g0: each
 * table vector is loaded once for the two blocks, halving the table reads from L2 (benchmarks log,
 * "t158: two blocks per table read"). Per row: FMAs into 8 rotating accumulators (short
 * chains). pf: 26 lines (1664 bytes) to prefetch into L1, two per byte column, or NULL. */
T16F_TGT static inline void t16f_block32(const uint8_t *pa, size_t stride, int g0, int ng,
                                         const float *tab, const float *sca, const float *scb,
                                         __m512 *acca, __m512 *accb, const char *pf) {
    int nc = 13 * ng;
    __mmask64 lm = ng == 4 ? 0x000FFFFFFFFFFFFFull : ((1ull << nc) - 1);
    __m512i xs[2][13]; /* the transposed byte columns of both blocks */
    for (int h = 0; h < 2; h++) {
        const uint8_t *p = pa + (size_t)h * 16 * stride;
        __m512i X[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            X[i] = _mm512_maskz_loadu_epi8(lm, p + T16F_BITREV4[i] * stride + (size_t)g0 * 13);
        t16f_tp16(X);
#pragma GCC unroll 13
        for (int m = 0; m < 13; m++) xs[h][m] = X[T16F_DREG[m]];
    }
    const float *tg = tab + (size_t)g0 * 13 * 48;
#pragma GCC unroll 13
    for (int m = 0; m < 13; m++) {
        if (4 * m >= nc) break;
        __m512i LOa, HIa, LOb, HIb;
        if (pf) {
            _mm_prefetch(pf + 128 * m, _MM_HINT_T0);
            _mm_prefetch(pf + 128 * m + 64, _MM_HINT_T0);
        }
        t16f_split(xs[0][m], &LOa, &HIa);
        t16f_split(xs[1][m], &LOb, &HIb);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            int c = 4 * m + t; /* column c = byte j of group gi: c = 13 gi + j */
            if (c >= nc) continue;
            int gi = c / 13;
            const float *tt = tg + (size_t)c * 48;
            __m512 tlo = _mm512_load_ps(tt), th0 = _mm512_load_ps(tt + 16);
            __m512 th1 = _mm512_load_ps(tt + 32);
            __m512 sa = _mm512_load_ps(sca + 16 * gi), sb = _mm512_load_ps(scb + 16 * gi);
            __m512i la = t ? _mm512_srli_epi32(LOa, 8 * t) : LOa;
            __m512i ha = t ? _mm512_srli_epi32(HIa, 8 * t) : HIa;
            __m512i lb = t ? _mm512_srli_epi32(LOb, 8 * t) : LOb;
            __m512i hb = t ? _mm512_srli_epi32(HIb, 8 * t) : HIb;
            acca[(2 * c) & 7] =
                _mm512_fmadd_ps(sa, _mm512_permutexvar_ps(la, tlo), acca[(2 * c) & 7]);
            acca[(2 * c + 1) & 7] = _mm512_fmadd_ps(sa, _mm512_permutex2var_ps(th0, ha, th1),
                                                    acca[(2 * c + 1) & 7]);
            accb[(2 * c) & 7] =
                _mm512_fmadd_ps(sb, _mm512_permutexvar_ps(lb, tlo), accb[(2 * c) & 7]);
            accb[(2 * c + 1) & 7] = _mm512_fmadd_ps(sb, _mm512_permutex2var_ps(th0, hb, th1),
                                                    accb[(2 * c + 1) & 7]);
        }
    }
}

T16F_TGT static inline __m512 t16f_sum8(const __m512 *a) {
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                         _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])));
}

/* The 32 rows at p (row stride 13G bytes; scales at sc, row stride G) -> y[0 .. 32). st: 2 x
 * T16F_ST_FLOATS(G) floats. next: the following 32 rows, prefetched into L1 in `per`-byte slices
 * (<= 1664), one per 4-group step, spread over the step's byte columns rather than issued as a
 * burst (both paid off: benchmarks log, "CPU kernel notes"), with their scales, or NULL. */
T16F_TGT static inline void t16f_rows32(const uint8_t *p, const uint16_t *sc, int G,
                                        const float *tab, float *st, const uint8_t *next,
                                        float *y) {
    size_t stride = (size_t)G * 13, steps = (size_t)(G + 3) / 4;
    size_t per = (32 * stride + steps - 1) / steps;
    float *stb = st + T16F_ST_FLOATS(G);
    t16f_scales(sc, G, st);
    t16f_scales(sc + (size_t)16 * G, G, stb);
    __m512 acca[8], accb[8];
    for (int i = 0; i < 8; i++) acca[i] = accb[i] = _mm512_setzero_ps();
    /* The next rows' scales (64G bytes from sc + 32G) go the same way, a slice per step: without
     * them each block began with a burst of misses (benchmarks log, "Scales prefetched"). The
     * last slice may reach a little past them; a prefetch never faults, and an integer address
     * keeps the arithmetic defined. */
    uintptr_t ns = next ? (uintptr_t)(sc + (size_t)32 * G) : 0;
    size_t sper = ((size_t)64 * G + steps - 1) / steps;
    for (int g0 = 0; g0 < G; g0 += 4) {
        if (ns) {
            for (size_t o = 0; o < sper; o += 64) _mm_prefetch((const char *)(ns + o), _MM_HINT_T0);
            ns += sper;
        }
        t16f_block32(p, stride, g0, G - g0 < 4 ? G - g0 : 4, tab, st + 16 * g0, stb + 16 * g0,
                     acca, accb, (const char *)next);
        if (next) next += per;
    }
    _mm512_storeu_ps(y, t16f_sum8(acca));
    _mm512_storeu_ps(y + 16, t16f_sum8(accb));
}

/* y[r] for r in [r0, r1) with the tables of one input vector. Rows go 32 at a time from r0; the
 * k < 32 rows left are copied into a zero-padded 32-row block in scratch and run through the same
 * code (lane-wise, so each row's result is the same as in any other block). pf_end: rows below
 * it may be prefetched (the caller's whole row range). scratch: T16F_SCRATCH_FLOATS(G) floats,
 * 64-byte aligned. */
T16F_TGT void t16f_span(const uint8_t *pk, const uint16_t *sc, int G, const float *tab, float *y,
                        int r0, int r1, int pf_end, float *scratch) {
    size_t stride = (size_t)G * 13;
    float *st = scratch;
    int r = r0;
    for (; r + 32 <= r1; r += 32) {
        const uint8_t *p = pk + (size_t)r * stride;
        t16f_rows32(p, sc + (size_t)r * G, G, tab, st, r + 64 <= pf_end ? p + 32 * stride : NULL,
                    y + r);
    }
    if (r < r1) {
        int k = r1 - r;
        uint8_t *tb = (uint8_t *)(scratch + 2 * T16F_ST_FLOATS(G));
        uint16_t *ts = (uint16_t *)(tb + 32 * stride); /* 32 * 13G bytes: even */
        float *ty = (float *)(ts + (size_t)32 * G + 32); /* after 64 bytes of pad */
        memcpy(tb, pk + (size_t)r * stride, (size_t)k * stride);
        memset(tb + (size_t)k * stride, 0, (size_t)(32 - k) * stride);
        memcpy(ts, sc + (size_t)r * G, (size_t)k * G * 2);
        memset(ts + (size_t)k * G, 0, (size_t)(32 - k) * G * 2);
        t16f_rows32(tb, ts, G, tab, st, NULL, ty);
        memcpy(y + r, ty, (size_t)k * 4);
    }
}
