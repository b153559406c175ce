/* mxfp4 CPU kernels on the packed bytes (FORMAT.md "mxfp4"): the codec hooks mxfp4_prepare,
 * mxfp4_rows of the CPU expert library.
 *
 * Row r of a [rows, cols] matrix: weight_packed u8 [rows, cols/2] (byte j: column 2j in the low
 * nibble, 2j+1 in the high; nibble = E2M1, bit 3 the sign) and weight_scale u8 [rows, cols/32]
 * (E8M0 e: 2^(e-127), e = 0 is the subnormal 2^-127, 0xFF is rejected with -3 as the NumPy
 * decoder rejects it). Per 32-column group the kernel builds the 16 decoded values
 * E2M1[nibble] * 2^(e-127) in fp32, exactly formats/mxfp4.py's `values * scale`, and looks the
 * nibbles up in it. Paths: scalar, avx2 (two 8-entry permutes), avx512 (one 16-entry permute,
 * columns in split order: see decode_split_avx512).
 * Requires cols % 64 == 0 (the driver's block; K3's 3584 and 3072 are).
 */
#include "block_rows.h"
#include "lut_decode.h"

static const float E2M1[16] __attribute__((aligned(64))) = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0(uint8_t e) { return bits_f32(e ? (uint32_t)e << 23 : 0x00400000u); }

static inline const uint8_t *block_bytes(const mat_t *m, int r, int b) {
    return m->packed + (size_t)r * m->row_bytes + (size_t)b * (BLOCK / 2);
}

static inline const uint8_t *block_scales(const mat_t *m, int r, int b) {
    return m->scale + (size_t)r * m->scale_row_bytes + (size_t)b * 2;
}

static void decode_scalar(const mat_t *m, int r, int b, float *w) {
    const uint8_t *p = block_bytes(m, r, b), *e = block_scales(m, r, b);
    for (int h = 0; h < 2; h++) {
        float lut[16], s = e8m0(e[h]);
        for (int i = 0; i < 16; i++) lut[i] = E2M1[i] * s;
        nib32_scalar(p + 16 * h, lut, w + 32 * h);
    }
}

__attribute__((target("avx2,fma"))) static void decode_avx2(const mat_t *m, int r, int b,
                                                            float *w) {
    const uint8_t *p = block_bytes(m, r, b), *e = block_scales(m, r, b);
    for (int h = 0; h < 2; h++) {
        __m256 s = _mm256_set1_ps(e8m0(e[h]));
        nib32_avx2(p + 16 * h, _mm256_mul_ps(_mm256_load_ps(E2M1), s),
                   _mm256_mul_ps(_mm256_load_ps(E2M1 + 8), s), w + 32 * h);
    }
}

/* avx512: "split order". Within each 32-column group the kernel works on the 16 even columns
 * (the low nibbles) and then the 16 odd ones (the high nibbles): a group's 16 bytes widen to 16
 * dwords, and vpermps, which reads index bits 3:0 only, looks up the low nibbles as they are and
 * the high ones after one shift, with no interleave. The inputs are put in the same order once
 * per call (split_inputs, into a per-thread buffer, SPLIT_TOKENS tokens at a time), so each
 * (row, token) is still one fp32 accumulation chain over every column, only in another fixed
 * order, and the few-token kernel (direct_avx512) and the decode-then-tile path
 * (rows_tpl_avx512 on split-order blocks) run the same chains: 16 lanes, 16 columns a step in
 * split order, then hsum512. */
__attribute__((target(AVX512_TARGET))) static inline __m512 lut_avx512(uint8_t e) {
    return _mm512_mul_ps(_mm512_load_ps(E2M1), _mm512_set1_ps(e8m0(e)));
}

__attribute__((target(AVX512_TARGET))) static void decode_split_avx512(const mat_t *m, int r,
                                                                       int b, float *w) {
    const uint8_t *p = block_bytes(m, r, b), *e = block_scales(m, r, b);
    for (int h = 0; h < 2; h++) {
        __m512 lut = lut_avx512(e[h]);
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
        _mm512_store_ps(w + 32 * h, _mm512_permutexvar_ps(v, lut));
        _mm512_store_ps(w + 32 * h + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut));
    }
}

/* Rows of X [n, cols] (stride ldx, 64-byte aligned) into xs in split order. */
__attribute__((target(AVX512_TARGET))) static void split_inputs(const float *X, int ldx, int n,
                                                                int cols, float *xs) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int t = 0; t < n; t++)
        for (int k = 0; k < cols; k += 32) {
            const float *x = X + (size_t)t * ldx + k;
            float *o = xs + (size_t)t * ldx + k;
            __m512 a = _mm512_load_ps(x), b = _mm512_load_ps(x + 16);
            _mm512_store_ps(o, _mm512_permutex2var_ps(a, even, b));
            _mm512_store_ps(o + 16, _mm512_permutex2var_ps(a, odd, b));
        }
}

/* NR rows from r x TT tokens (both constants at each call site) straight from the packed bytes:
 * no decoded block in memory. The chains are tile_avx512's over decode_split_avx512's blocks.
 * pf: the next block's packed rows (RB rows, contiguous), prefetched into L1 one line per group
 * (RB * 16 bytes a group = 64 at RB 4; why: BENCHMARKS.md, "CPU kernel notes"), or NULL. */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
direct_avx512(const mat_t *m, const float *xs, int ldx, int TT, int NR, float *Y, int ldy,
              int r, const uint8_t *pf) {
    __m512 acc[RB][4];
    const uint8_t *p[RB], *e[RB];
    for (int i = 0; i < NR; i++) {
        p[i] = m->packed + (size_t)(r + i) * m->row_bytes;
        e[i] = m->scale + (size_t)(r + i) * m->scale_row_bytes;
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    }
    for (int g = 0; g < m->cols / 32; g++) {
        __m512 xl[4], xh[4];
        for (int j = 0; j < TT; j++) {
            xl[j] = _mm512_load_ps(xs + (size_t)j * ldx + 32 * g);
            xh[j] = _mm512_load_ps(xs + (size_t)j * ldx + 32 * g + 16);
        }
        if (pf) _mm_prefetch((const char *)pf + 64 * g, _MM_HINT_T0);
        for (int i = 0; i < NR; i++) {
            __m512 lut = lut_avx512(e[i][g]);
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p[i] + 16 * g)));
            __m512 wl = _mm512_permutexvar_ps(v, lut);
            __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
            for (int j = 0; j < TT; j++) {
                acc[i][j] = _mm512_fmadd_ps(wl, xl[j], acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(wh, xh[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < TT; j++) Y[(size_t)j * ldy + r + i] = hsum512(acc[i][j]);
}

/* Rows [r0, r1) for TT <= 4 tokens: RB-row blocks, then the tail a row at a time. */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
few_avx512(const mat_t *m, const float *xs, int ldx, int TT, float *Y, int ldy, int r0, int r1) {
    int r = r0;
    for (; r + RB <= r1; r += RB)
        direct_avx512(m, xs, ldx, TT, RB, Y, ldy, r,
                      r + 2 * RB <= r1 ? m->packed + (size_t)(r + RB) * m->row_bytes : NULL);
    for (; r < r1; r++) direct_avx512(m, xs, ldx, TT, 1, Y, ldy, r, NULL);
}

static void rows_scalar(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                        int r0, int r1, float *w) {
    rows_tpl_scalar(decode_scalar, m, X, ldx, n, Y, ldy, r0, r1, w);
}

__attribute__((target("avx2,fma"))) static void rows_avx2(const mat_t *m, const float *X,
                                                          int ldx, int n, float *Y, int ldy,
                                                          int r0, int r1, float *w) {
    rows_tpl_avx2(decode_avx2, m, X, ldx, n, Y, ldy, r0, r1, w);
}

/* Tokens per batch of reordered inputs: bounds the per-thread buffer (64 x cols floats, 900 KB
 * at K3) for long prefills; a batch above 4 tokens still decodes each row block once. */
#define SPLIT_TOKENS 64

__attribute__((target(AVX512_TARGET))) static void rows_avx512(const mat_t *m, const float *X,
                                                               int ldx, int n, float *Y, int ldy,
                                                               int r0, int r1, float *w) {
    int tc = n < SPLIT_TOKENS ? n : SPLIT_TOKENS;
    float *xs = thread_floats(THREAD_BUF_MXFP4_INPUTS, (size_t)tc * ldx);
    if (!xs) { /* out of memory for the reordered inputs: correct, other summation order */
        rows_avx2(m, X, ldx, n, Y, ldy, r0, r1, w);
        return;
    }
    for (int t0 = 0; t0 < n; t0 += tc) {
        int nt = n - t0 < tc ? n - t0 : tc;
        float *y = Y + (size_t)t0 * ldy;
        split_inputs(X + (size_t)t0 * ldx, ldx, nt, m->cols, xs);
        switch (nt) {
        case 1: few_avx512(m, xs, ldx, 1, y, ldy, r0, r1); break;
        case 2: few_avx512(m, xs, ldx, 2, y, ldy, r0, r1); break;
        case 3: few_avx512(m, xs, ldx, 3, y, ldy, r0, r1); break;
        case 4: few_avx512(m, xs, ldx, 4, y, ldy, r0, r1); break;
        default: rows_tpl_avx512(decode_split_avx512, m, xs, ldx, nt, y, ldy, r0, r1, w);
        }
    }
}

int mxfp4_prepare(mat_t *m) {
    m->row_bytes = (size_t)m->cols / 2;
    m->scale_row_bytes = (size_t)m->cols / 32;
    /* E8M0 0xFF is NaN in OCP MX; the NumPy decoder refuses it, so the kernel does too. */
    if (memchr(m->scale, 0xFF, (size_t)m->rows * m->scale_row_bytes)) return -3;
    return 0;
}

rows_fn mxfp4_rows(const mat_t *m, int isa) {
    (void)m;
    return isa >= 2 ? rows_avx512 : isa == 1 ? rows_avx2 : rows_scalar;
}
