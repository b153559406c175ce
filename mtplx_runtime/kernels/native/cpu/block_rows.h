/* Generic row kernels of the CPU expert library: decode a block of rows once, then a
 * register-tiled dot over it for every tile of tokens. Inline templates: each codec source
 * instantiates them with its own decoders (decode_fn), so the decoder inlines into the loop. */
#ifndef MTPLX_BLOCK_ROWS_H
#define MTPLX_BLOCK_ROWS_H

#include "cpu_common.h"

/* ---- generic row kernels ----
 * A block of RB rows is decoded once into a float buffer (RB x cols, ~57 KB at K3: it stays in
 * L2), then every tile of up to TT tokens (4 on avx512, 2 on avx2) runs a register-tiled dot
 * over it: RB x TT accumulators, fed by RB weight loads and TT input loads per SIMD step, so n
 * tokens cost one decode and n/TT passes over the buffer. Every (row, token) result is one
 * accumulation chain over the columns in a fixed order whatever the tile shape, so it does not
 * depend on n, the tile a token falls in, or the rows around it (n tokens == n one-token calls,
 * bit for bit).
 * Rows past r1 in the last block decode as zeros and their results are dropped. */

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

/* The few-token kernels prefetch the next RB-row block of packed bytes (rows are contiguous,
 * row_bytes apart) while they work on this one: at 64-column block b, the b-th of cols/64 equal
 * slices of it (why: benchmarks log, "CPU kernel notes"). next: that block, or NULL when the
 * call's rows end first. */
static inline __attribute__((always_inline)) void prefetch_slice(const mat_t *m,
                                                                 const uint8_t *next, int b) {
    if (!next) return;
    size_t per = RB * m->row_bytes / (size_t)(m->cols / BLOCK);
    for (size_t o = b * per; o < (b + 1) * per; o += 64)
        _mm_prefetch((const char *)next + o, _MM_HINT_T0);
}

static inline const uint8_t *next_block(const mat_t *m, int r, int r1) {
    return r + 2 * RB <= r1 ? m->packed + (size_t)(r + RB) * m->row_bytes : NULL;
}

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
           int r, int rb, const uint8_t *next) {
    float wb[RB][BLOCK] __attribute__((aligned(64)));
    __m256 acc[RB][2];
    for (int i = 0; i < RB; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        prefetch_slice(m, next, b);
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
            const uint8_t *next = next_block(m, r, r1);
            if (n == 2) fused_avx2(dec, m, X, ldx, 2, Y, ldy, r, rb, next);
            else fused_avx2(dec, m, X, ldx, 1, Y, ldy, r, rb, next);
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
             int r, int rb, const uint8_t *next) {
    float wb[RB][BLOCK] __attribute__((aligned(64)));
    __m512 acc[RB][4];
    for (int i = 0; i < RB; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        prefetch_slice(m, next, b);
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

/* Y rows [r, r + rb) of n tokens from RB decoded rows w: tiles of 4 tokens, then the
 * remainder as one constant-width tile. */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
tiles_avx512(const float *w, int ldw, const float *X, int ldx, int n, int cols, float *Y, int ldy,
             int r, int rb) {
    int t = 0;
    for (; t + 4 <= n; t += 4)
        tile_avx512(w, ldw, X + (size_t)t * ldx, ldx, 4, cols, Y + (size_t)t * ldy + r, ldy, rb);
    const float *x = X + (size_t)t * ldx;
    float *y = Y + (size_t)t * ldy + r;
    switch (n - t) {
    case 3: tile_avx512(w, ldw, x, ldx, 3, cols, y, ldy, rb); break;
    case 2: tile_avx512(w, ldw, x, ldx, 2, cols, y, ldy, rb); break;
    case 1: tile_avx512(w, ldw, x, ldx, 1, cols, y, ldy, rb); break;
    }
}

__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
rows_tpl_avx512(decode_fn dec, const mat_t *m, const float *X, int ldx, int n, float *Y,
                int ldy, int r0, int r1, float *w) {
    int ldw = block_stride(m->cols);
    for (int r = r0; r < r1; r += RB) {
        int rb = r1 - r < RB ? r1 - r : RB;
        switch (n) { /* few tokens: decode block by block in L1 (constant-width tiles) */
        case 1: fused_avx512(dec, m, X, ldx, 1, Y, ldy, r, rb, next_block(m, r, r1)); continue;
        case 2: fused_avx512(dec, m, X, ldx, 2, Y, ldy, r, rb, next_block(m, r, r1)); continue;
        case 3: fused_avx512(dec, m, X, ldx, 3, Y, ldy, r, rb, next_block(m, r, r1)); continue;
        case 4: fused_avx512(dec, m, X, ldx, 4, Y, ldy, r, rb, next_block(m, r, r1)); continue;
        }
        decode_rows(dec, m, r, rb, w, ldw);
        tiles_avx512(w, ldw, X, ldx, n, m->cols, Y, ldy, r, rb);
    }
}

#endif
