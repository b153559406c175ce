/* Split-order nibble kernels (avx512, then avx2 below) for the codecs whose codes are 4-bit
 * nibbles, byte j holding code 2j low and 2j+1 high: mxfp4 and ct-int 4-bit. Inline templates,
 * instantiated by each codec with its own per-block tables (lut2_fn, lut2_avx2_fn).
 *
 * Within each 32-column half of a 64-column block the kernels work on the 16 even columns (the
 * low nibbles) and then the 16 odd ones (the high nibbles): 16 bytes widen to 16 dwords, and
 * vpermps, which reads index bits 3:0 only, looks up the low nibbles as they are and the high
 * ones after one shift, with no interleave. The inputs are put in the same order once per call
 * (split_inputs, into a per-thread buffer, SPLIT_TOKENS tokens at a time), so each (row, token)
 * is still one fp32 accumulation chain over every column, only in another fixed order, and the
 * few-token kernel (split_direct) and the decode-then-tile path (rows_tpl_avx512 on split_decode
 * blocks) run the same chains: 16 lanes, 16 columns a step in split order, then hsum512. */
#ifndef MTPLX_NIB_SPLIT_H
#define MTPLX_NIB_SPLIT_H

#include "block_rows.h"

/* Tokens per batch of reordered inputs: bounds the per-thread buffer (64 x cols floats, 900 KB
 * at K3) for long prefills; a batch above 4 tokens still decodes each row block once. */
#define SPLIT_TOKENS 64

/* The 16-entry tables of 64-column block b of row r: lut[h] serves its 32-column half h. */
typedef void (*lut2_fn)(const mat_t *m, int r, int b, __m512 *lut);

static inline const uint8_t *nib_block(const mat_t *m, int r, int b) {
    return m->packed + (size_t)r * m->row_bytes + (size_t)b * (BLOCK / 2);
}

/* Rows of X [n, cols] (stride ldx, 64-byte aligned) into xs in split order. */
__attribute__((target(AVX512_TARGET))) static inline void split_inputs(const float *X, int ldx,
                                                                       int n, int cols,
                                                                       float *xs) {
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

/* Block b of row r into w (64 floats) in split order. */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
split_decode(lut2_fn lf, const mat_t *m, int r, int b, float *w) {
    const uint8_t *p = nib_block(m, r, b);
    __m512 lut[2];
    lf(m, r, b, lut);
    for (int h = 0; h < 2; h++) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
        _mm512_store_ps(w + 32 * h, _mm512_permutexvar_ps(v, lut[h]));
        _mm512_store_ps(w + 32 * h + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[h]));
    }
}

/* NR rows from r x TT tokens (both constants at each call site) straight from the packed bytes:
 * no decoded block in memory; the next row block is prefetched as block_rows.h's few-token
 * kernels do (next: next_block's). */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
split_direct(lut2_fn lf, const mat_t *m, const float *xs, int ldx, int TT, int NR, float *Y,
             int ldy, int r, const uint8_t *next) {
    __m512 acc[RB][4];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        prefetch_slice(m, next, b);
        __m512 x[4][4]; /* [j][quarter]: the block's inputs, loaded once for all NR rows */
        for (int j = 0; j < TT; j++)
            for (int q = 0; q < 4; q++)
                x[j][q] = _mm512_load_ps(xs + (size_t)j * ldx + (size_t)b * BLOCK + 16 * q);
        for (int i = 0; i < NR; i++) {
            const uint8_t *p = nib_block(m, r + i, b);
            __m512 lut[2];
            lf(m, r + i, b, lut);
            for (int h = 0; h < 2; h++) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
                __m512 wl = _mm512_permutexvar_ps(v, lut[h]);
                __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[h]);
                for (int j = 0; j < TT; j++) {
                    acc[i][j] = _mm512_fmadd_ps(wl, x[j][2 * h], acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(wh, x[j][2 * h + 1], acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < TT; j++) Y[(size_t)j * ldy + r + i] = hsum512(acc[i][j]);
}

/* Rows [r0, r1) for TT <= 4 tokens: RB-row blocks, then the tail a row at a time. */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
split_few(lut2_fn lf, const mat_t *m, const float *xs, int ldx, int TT, float *Y, int ldy,
          int r0, int r1) {
    int r = r0;
    for (; r + RB <= r1; r += RB)
        split_direct(lf, m, xs, ldx, TT, RB, Y, ldy, r, next_block(m, r, r1));
    for (; r < r1; r++) split_direct(lf, m, xs, ldx, TT, 1, Y, ldy, r, NULL);
}

/* The row kernel: dec is split_decode with lf (a decode_fn for rows_tpl_avx512); fallback runs
 * when the per-thread input buffer cannot be had (correct, other summation order). */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
split_rows(lut2_fn lf, decode_fn dec, rows_fn fallback, const mat_t *m, const float *X, int ldx,
           int n, float *Y, int ldy, int r0, int r1, float *w) {
    int tc = n < SPLIT_TOKENS ? n : SPLIT_TOKENS;
    float *xs = thread_floats(THREAD_BUF_SPLIT_INPUTS, (size_t)tc * ldx);
    if (!xs) {
        fallback(m, X, ldx, n, Y, ldy, r0, r1, w);
        return;
    }
    for (int t0 = 0; t0 < n; t0 += tc) {
        int nt = n - t0 < tc ? n - t0 : tc;
        float *y = Y + (size_t)t0 * ldy;
        split_inputs(X + (size_t)t0 * ldx, ldx, nt, m->cols, xs);
        switch (nt) {
        case 1: split_few(lf, m, xs, ldx, 1, y, ldy, r0, r1); break;
        case 2: split_few(lf, m, xs, ldx, 2, y, ldy, r0, r1); break;
        case 3: split_few(lf, m, xs, ldx, 3, y, ldy, r0, r1); break;
        case 4: split_few(lf, m, xs, ldx, 4, y, ldy, r0, r1); break;
        default: rows_tpl_avx512(dec, m, xs, ldx, nt, y, ldy, r0, r1, w);
        }
    }
}

/* ---- avx2: the same idea on 8 lanes. Within each 16-column piece (8 bytes) the 8 even columns
 * (low nibbles) come first, then the 8 odd ones (high nibbles); lut16_avx2 (two 8-entry
 * permutes and a blend on index bit 3) reads the low nibble as it is and the high one after a
 * shift. Each (row, token) is one chain of 8 lanes over the columns in that order, then hsum256,
 * in the direct kernel (split_direct_avx2, one token) and in rows_tpl_avx2 over split_decode_avx2
 * blocks alike. */

/* The 16-entry tables of 64-column block b of row r: lut[h][0] entries 0..7, lut[h][1] 8..15,
 * for its 32-column half h. */
typedef void (*lut2_avx2_fn)(const mat_t *m, int r, int b, __m256 lut[2][2]);

/* Rows of X [n, cols] (stride ldx, 32-byte aligned) into xs in the avx2 split order. */
__attribute__((target("avx2,fma"))) static inline void split_inputs_avx2(const float *X, int ldx,
                                                                          int n, int cols,
                                                                          float *xs) {
    for (int t = 0; t < n; t++)
        for (int k = 0; k < cols; k += 16) {
            const float *x = X + (size_t)t * ldx + k;
            float *o = xs + (size_t)t * ldx + k;
            __m256 a = _mm256_load_ps(x), b = _mm256_load_ps(x + 8);
            /* shuffle_ps keeps 128-bit lanes: a0 a2 b0 b2 | a4 a6 b4 b6; 0xD8 orders the pairs */
            _mm256_store_ps(o, _mm256_castpd_ps(_mm256_permute4x64_pd(
                                   _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8)));
            _mm256_store_ps(o + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(
                                       _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8)));
        }
}

/* The 8 bytes of piece q (16 columns) of block b of row r, widened to dwords. */
__attribute__((target("avx2,fma"))) static inline __m256i nib_piece_avx2(const mat_t *m, int r,
                                                                          int b, int q) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nib_block(m, r, b) + 8 * q)));
}

/* Block b of row r into w (64 floats) in the avx2 split order. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
split_decode_avx2(lut2_avx2_fn lf, const mat_t *m, int r, int b, float *w) {
    __m256 lut[2][2];
    lf(m, r, b, lut);
    for (int q = 0; q < 4; q++) {
        __m256i v = nib_piece_avx2(m, r, b, q);
        _mm256_store_ps(w + 16 * q, lut16_avx2(v, lut[q / 2][0], lut[q / 2][1]));
        _mm256_store_ps(w + 16 * q + 8,
                        lut16_avx2(_mm256_srli_epi32(v, 4), lut[q / 2][0], lut[q / 2][1]));
    }
}

/* NR rows from r, one token, straight from the packed bytes (no decoded block in memory); the
 * next row block is prefetched as block_rows.h's few-token kernels do. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
split_direct_avx2(lut2_avx2_fn lf, const mat_t *m, const float *xs, int NR, float *y, int r,
                  const uint8_t *next) {
    __m256 acc[RB];
    for (int i = 0; i < NR; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        prefetch_slice(m, next, b);
        const float *x = xs + (size_t)b * BLOCK;
        for (int i = 0; i < NR; i++) { /* a row at a time: its 4 table registers stay put */
            __m256 lut[2][2];
            lf(m, r + i, b, lut);
            for (int q = 0; q < 4; q++) {
                __m256i v = nib_piece_avx2(m, r + i, b, q);
                const __m256 *t = lut[q / 2];
                acc[i] = _mm256_fmadd_ps(lut16_avx2(v, t[0], t[1]),
                                         _mm256_load_ps(x + 16 * q), acc[i]);
                acc[i] = _mm256_fmadd_ps(lut16_avx2(_mm256_srli_epi32(v, 4), t[0], t[1]),
                                         _mm256_load_ps(x + 16 * q + 8), acc[i]);
            }
        }
    }
    for (int i = 0; i < NR; i++) y[r + i] = hsum256(acc[i]);
}

/* The avx2 row kernel: one token runs split_direct_avx2 on RB-row blocks (then the tail a row
 * at a time), more go through rows_tpl_avx2 with dec (split_decode_avx2 with lf); fallback runs
 * when the per-thread input buffer cannot be had (correct, other summation order). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
split_rows_avx2(lut2_avx2_fn lf, decode_fn dec, rows_fn fallback, const mat_t *m, const float *X,
                int ldx, int n, float *Y, int ldy, int r0, int r1, float *w) {
    int tc = n < SPLIT_TOKENS ? n : SPLIT_TOKENS;
    float *xs = thread_floats(THREAD_BUF_SPLIT_INPUTS, (size_t)tc * ldx);
    if (!xs) {
        fallback(m, X, ldx, n, Y, ldy, r0, r1, w);
        return;
    }
    for (int t0 = 0; t0 < n; t0 += tc) {
        int nt = n - t0 < tc ? n - t0 : tc;
        float *y = Y + (size_t)t0 * ldy;
        split_inputs_avx2(X + (size_t)t0 * ldx, ldx, nt, m->cols, xs);
        if (nt > 1) {
            rows_tpl_avx2(dec, m, xs, ldx, nt, y, ldy, r0, r1, w);
            continue;
        }
        int r = r0;
        for (; r + RB <= r1; r += RB)
            split_direct_avx2(lf, m, xs, RB, y, r, next_block(m, r, r1));
        for (; r < r1; r++) split_direct_avx2(lf, m, xs, 1, y, r, NULL);
    }
}

#endif
