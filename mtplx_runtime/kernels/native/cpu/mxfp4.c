/* mxfp4 CPU kernels on the packed bytes (FORMAT.md "mxfp4"): the codec hooks mxfp4_prepare,
 * mxfp4_rows of the CPU expert library.
 *
 * Row r of a [rows, cols] matrix: weight_packed u8 [rows, cols/2] (byte j: column 2j in the low
 * nibble, 2j+1 in the high; nibble = E2M1, bit 3 the sign) and weight_scale u8 [rows, cols/32]
 * (E8M0 e: 2^(e-127), e = 0 is the subnormal 2^-127, 0xFF is rejected with -3 as the NumPy
 * decoder rejects it). Per 32-column group the kernel builds the 16 decoded values
 * E2M1[nibble] * 2^(e-127) in fp32, exactly formats/mxfp4.py's `values * scale`, and looks the
 * nibbles up in it. Paths: scalar, avx2 (two 8-entry permutes) and avx512 (one 16-entry
 * permute), both with columns in split order (nib_split.h), avx512bf16 (token rows of bf16
 * values: unscaled E2M1 weights on vdpbf16ps, the scales in an fp32 FMA per 128 columns; other
 * rows: avx512).
 * Requires cols % 64 == 0 (the driver's block; K3's 3584 and 3072 are).
 */
#include "block_rows.h"
#include "lut_decode.h"
#include "nib_split.h"

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

/* avx512: split order (nib_split.h), one table per 32-column group. */
__attribute__((target(AVX512_TARGET))) static inline void lut2_avx512(const mat_t *m, int r,
                                                                      int b, __m512 *lut) {
    const uint8_t *e = block_scales(m, r, b);
    for (int h = 0; h < 2; h++)
        lut[h] = _mm512_mul_ps(_mm512_load_ps(E2M1), _mm512_set1_ps(e8m0(e[h])));
}

__attribute__((target(AVX512_TARGET))) static void decode_split_avx512(const mat_t *m, int r,
                                                                       int b, float *w) {
    split_decode(lut2_avx512, m, r, b, w);
}

/* avx2: split order too (nib_split.h), two 8-entry halves per 32-column group. */
__attribute__((target("avx2,fma"))) static inline void lut2_avx2(const mat_t *m, int r, int b,
                                                                  __m256 lut[2][2]) {
    const uint8_t *e = block_scales(m, r, b);
    for (int h = 0; h < 2; h++) {
        __m256 s = _mm256_set1_ps(e8m0(e[h]));
        lut[h][0] = _mm256_mul_ps(_mm256_load_ps(E2M1), s);
        lut[h][1] = _mm256_mul_ps(_mm256_load_ps(E2M1 + 8), s);
    }
}

__attribute__((target("avx2,fma"))) static void decode_split_avx2(const mat_t *m, int r, int b,
                                                                  float *w) {
    split_decode_avx2(lut2_avx2, m, r, b, w);
}

static void rows_scalar(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                        int r0, int r1, float *w) {
    rows_tpl_scalar(decode_scalar, m, X, ldx, n, Y, ldy, r0, r1, w);
}

/* The natural-order avx2 kernel: the split kernels' fallback when out of memory. */
__attribute__((target("avx2,fma"))) static void rows_avx2_plain(const mat_t *m, const float *X,
                                                                int ldx, int n, float *Y,
                                                                int ldy, int r0, int r1,
                                                                float *w) {
    rows_tpl_avx2(decode_avx2, m, X, ldx, n, Y, ldy, r0, r1, w);
}

__attribute__((target("avx2,fma"))) static void rows_avx2(const mat_t *m, const float *X,
                                                          int ldx, int n, float *Y, int ldy,
                                                          int r0, int r1, float *w) {
    split_rows_avx2(lut2_avx2, decode_split_avx2, rows_avx2_plain, m, X, ldx, n, Y, ldy, r0, r1,
                    w);
}

__attribute__((target(AVX512_TARGET))) static void rows_avx512(const mat_t *m, const float *X,
                                                               int ldx, int n, float *Y, int ldy,
                                                               int r0, int r1, float *w) {
    split_rows(lut2_avx512, decode_split_avx512, rows_avx2_plain, m, X, ldx, n, Y, ldy, r0, r1,
               w);
}

/* ---- avx512bf16 (isa 3): token rows whose inputs are all bf16 values ----
 * A bf16 input times an E2M1 value is exact in fp32, so a row of bf16 inputs can run on
 * vdpbf16ps, 32 multiply-adds per instruction. The row's bytes are read 64 at a time: 128
 * columns, four 32-column groups, group L in 128-bit lane L. Shifting every word right by 4k
 * (k = 0..3) puts one nibble in each word's low bits, and vpermw turns those into 32 unscaled
 * E2M1 values as bf16: word 8L + w holds column 32L + 4w + k (bf16_inputs puts the inputs in
 * that order). Four vdpbf16ps (k = 0..3) accumulate into a zeroed register p, so fp32 lane d
 * sums 8 exact products of group L = d / 4 (each instruction adds its two products one at a
 * time, odd word first, rounding after each); then one fp32 FMA adds p times the groups'
 * scales 2^(e-127) into the lane's accumulator; hsum512 at the end. Every (row, token) is that
 * one chain whatever the token count or tile, so n tokens == n one-token calls bit for bit.
 * Scales never pass through bf16, so every E8M0 byte (0, the subnormal 2^-127, too) is exact
 * here. When cols % 128 == 64 the last 128 columns are half zeros (weights and inputs). */

/* Words 0..15 the E2M1 values as bf16; 16..31 again: vpermw reads index bits 4:0 and bit 4 is
 * the next nibble's low bit. */
static const uint16_t E2M1_BF16[32] __attribute__((aligned(64))) = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

/* The lowest and past-the-highest |x| bit patterns a bf16-path input may have besides ±0:
 * exponents 9..246. Products with E2M1 are then multiples of 2^-126, so no sum of them is an
 * fp32 subnormal (vdpbf16ps treats subnormal inputs as zero and flushes subnormal results), and
 * p's 8 products and their sums are finite: vdpbf16ps is then exact products and RNE adds, as
 * the tests' NumPy emulation assumes. */
#define BF16_X_LO (9u << 23)
#define BF16_X_HI (247u << 23)

/* 128-column steps of a row (the last may be half). */
static inline int bf16_steps(int cols) { return (cols + 127) / 128; }

/* 1 when every input of x[0..cols) is ±0 or a bf16 value with an exponent in 9..246. */
__attribute__((target(BF16_TARGET))) static int bf16_row(const float *x, int cols) {
    const __m512i low = _mm512_set1_epi32(0xFFFF), abs = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i lo = _mm512_set1_epi32(BF16_X_LO);
    const __m512i span = _mm512_set1_epi32(BF16_X_HI - BF16_X_LO);
    __mmask16 bad = 0;
    for (int k = 0; k < cols; k += 16) {
        __m512i v = _mm512_load_si512(x + k), a = _mm512_and_si512(v, abs);
        bad |= _mm512_test_epi32_mask(v, low) |
               (_mm512_cmpge_epu32_mask(_mm512_sub_epi32(a, lo), span) &
                _mm512_test_epi32_mask(a, a));
    }
    return !bad;
}

/* Rows of X [n, cols] (bf16 values, checked) into xb as bf16 in the kernel's order: per token
 * 128 words per 128-column step s and shift k, xb[t][s][k][8L + w] = column 128s + 32L + 4w + k
 * (zero past cols). */
__attribute__((target(BF16_TARGET))) static void bf16_inputs(const float *X, int ldx, int n,
                                                             int cols, uint16_t *xb) {
    uint16_t idx[32] __attribute__((aligned(64)));
    for (int p = 0; p < 32; p++) /* word 8k + w: the high half of float 4w + k */
        idx[p] = (uint16_t)(2 * (4 * (p & 7) + (p >> 3)) + 1);
    const __m512i pick = _mm512_load_si512(idx);
    size_t ld = (size_t)128 * bf16_steps(cols);
    for (int t = 0; t < n; t++)
        for (int c = 0; c < 128 * bf16_steps(cols); c += 32) {
            const float *x = X + (size_t)t * ldx + c;
            __m512i v = c < cols ? _mm512_permutex2var_epi16(_mm512_load_si512(x), pick,
                                                             _mm512_load_si512(x + 16))
                                 : _mm512_setzero_si512();
            uint16_t *o = xb + t * ld + (size_t)(c / 128) * 128 + (c % 128) / 4;
            _mm_store_si128((__m128i *)o, _mm512_castsi512_si128(v));
            _mm_store_si128((__m128i *)(o + 32), _mm512_extracti32x4_epi32(v, 1));
            _mm_store_si128((__m128i *)(o + 64), _mm512_extracti32x4_epi32(v, 2));
            _mm_store_si128((__m128i *)(o + 96), _mm512_extracti32x4_epi32(v, 3));
        }
}

/* The scales of rows [r, r + nr) as the FMA's vectors: s[(i * S + st) * 16 + d] is the fp32
 * scale of group 4st + d / 4 of row r + i (S = bf16_steps; 0 past the row's groups). */
__attribute__((target(BF16_TARGET))) static void bf16_scales(const mat_t *m, int r, int nr,
                                                             float *s) {
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    int G = m->cols / 32, S = bf16_steps(m->cols);
    for (int i = 0; i < nr; i++) {
        const uint8_t *e = m->scale + (size_t)(r + i) * m->scale_row_bytes;
        float *o = s + (size_t)i * S * 16;
        int g = 0;
        for (; g + 16 <= G; g += 16) { /* 4 steps */
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(e + g)));
            __m512 f = _mm512_castsi512_ps(_mm512_mask_mov_epi32(
                _mm512_slli_epi32(v, 23), _mm512_testn_epi32_mask(v, v),
                _mm512_set1_epi32(0x00400000)));
            for (int q = 0; q < 4; q++)
                _mm512_store_ps(o + 4 * g + 16 * q,
                                _mm512_permutexvar_ps(
                                    _mm512_add_epi32(quad, _mm512_set1_epi32(4 * q)), f));
        }
        for (; g < 4 * S; g++)
            for (int d = 0; d < 4; d++) o[4 * g + d] = g < G ? e8m0(e[g]) : 0.0f;
    }
}

/* The L2 prefetch runs this many RB-row blocks ahead (next: one block ahead, into L1). */
#define BF16_FAR_BLOCKS 3

/* NR rows from r x TT tokens of xb (token stride 128 * S words), scale vectors s: see above.
 * next and far: the blocks to prefetch into L1 and L2, a 1/S slice per step (or NULL). */
__attribute__((target(BF16_TARGET))) static inline __attribute__((always_inline)) void
bf16_direct(const mat_t *m, const uint16_t *xb, int TT, int NR, const float *s, float *Y,
            int ldy, int r, const uint8_t *next, const uint8_t *far) {
    const __m512i tab = _mm512_load_si512(E2M1_BF16);
    int S = bf16_steps(m->cols);
    size_t ld = (size_t)128 * S, span = RB * m->row_bytes;
    __m512 acc[RB][4];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    for (int st = 0; st < S; st++) {
        if (next) /* 64 * RB bytes a step (fewer after a half step) */
            for (size_t o = (size_t)st * 64 * RB; o < (size_t)(st + 1) * 64 * RB && o < span;
                 o += 64) {
                _mm_prefetch((const char *)next + o, _MM_HINT_T0);
                if (far) _mm_prefetch((const char *)far + o, _MM_HINT_T1);
            }
        /* 64 bytes, or 32 in a half step (the row ends there) */
        __mmask64 half = 64 * (st + 1) > (int)m->row_bytes ? 0xFFFFFFFFull : ~0ull;
        for (int i = 0; i < NR; i++) {
            const uint8_t *p = m->packed + (size_t)(r + i) * m->row_bytes + 64 * (size_t)st;
            __m512i q = _mm512_maskz_loadu_epi8(half, p);
            __m512 sum[4];
            for (int j = 0; j < TT; j++) sum[j] = _mm512_setzero_ps();
            for (int k = 0; k < 4; k++) {
                __m512bh w = (__m512bh)_mm512_permutexvar_epi16(
                    k ? _mm512_srli_epi16(q, 4 * k) : q, tab);
                for (int j = 0; j < TT; j++)
                    sum[j] = _mm512_dpbf16_ps(
                        sum[j], w,
                        (__m512bh)_mm512_load_si512(xb + j * ld + (size_t)st * 128 + 32 * k));
            }
            __m512 sc = _mm512_load_ps(s + ((size_t)i * S + st) * 16);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_fmadd_ps(sum[j], sc, acc[i][j]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < TT; j++) Y[(size_t)j * ldy + r + i] = hsum512(acc[i][j]);
}

/* Up to 4 tokens of xb over NR rows (NR a constant at each call site). */
__attribute__((target(BF16_TARGET))) static inline __attribute__((always_inline)) void
bf16_tile(const mat_t *m, const uint16_t *xb, int tt, int NR, const float *s, float *Y, int ldy,
          int r, const uint8_t *next, const uint8_t *far) {
    switch (tt) {
    case 1: bf16_direct(m, xb, 1, NR, s, Y, ldy, r, next, far); break;
    case 2: bf16_direct(m, xb, 2, NR, s, Y, ldy, r, next, far); break;
    case 3: bf16_direct(m, xb, 3, NR, s, Y, ldy, r, next, far); break;
    default: bf16_direct(m, xb, 4, NR, s, Y, ldy, r, next, far);
    }
}

/* n tokens of xb over rows [r0, r1): per RB-row block (scale vectors built once), tiles of up
 * to 4 tokens; the block's bytes stay in L1 for the later tiles, the first prefetches the next
 * block's bytes into L1 and a later block's into L2, and the next scales are prefetched here
 * (why both: benchmarks log, "CPU kernel notes"). */
__attribute__((target(BF16_TARGET))) static void bf16_rows(const mat_t *m, const uint16_t *xb,
                                                           int n, float *Y, int ldy, int r0,
                                                           int r1, float *s) {
    size_t ld = (size_t)128 * bf16_steps(m->cols), sv = ld / 8; /* sv: a row's scale floats */
    for (int r = r0; r < r1; r += RB) {
        int nr = r1 - r < RB ? r1 - r : RB;
        bf16_scales(m, r, nr, s);
        if (next_block(m, r, r1))
            for (size_t o = 0; o < RB * m->scale_row_bytes; o += 64)
                _mm_prefetch((const char *)m->scale + (r + RB) * m->scale_row_bytes + o,
                             _MM_HINT_T0);
        for (int t = 0; t < n; t += 4) {
            const uint16_t *x = xb + t * ld;
            float *y = Y + (size_t)t * ldy;
            int tt = n - t < 4 ? n - t : 4;
            if (nr == RB) {
                int f = r + (BF16_FAR_BLOCKS + 1) * RB <= r1;
                const uint8_t *next = t ? NULL : next_block(m, r, r1);
                const uint8_t *far =
                    t || !f ? NULL : m->packed + (r + BF16_FAR_BLOCKS * RB) * m->row_bytes;
                if (tt < 3) {
                    bf16_tile(m, x, tt, RB, s, y, ldy, r, next, far);
                } else { /* 3-4 tokens: two half-block tiles (the accumulators stay in
                          * registers; measured: benchmarks log, "CPU kernel notes") */
                    bf16_tile(m, x, tt, RB / 2, s, y, ldy, r, next, far);
                    bf16_tile(m, x, tt, RB / 2, s + RB / 2 * sv, y, ldy, r + RB / 2, NULL,
                              NULL);
                }
                continue;
            }
            for (int i = 0; i < nr; i++)
                bf16_tile(m, x, tt, 1, s + i * sv, y, ldy, r + i, NULL, NULL);
        }
    }
}

/* The isa 3 row kernel: runs of consecutive tokens that all pass bf16_row take the bf16 path,
 * the others rows_avx512, so a token's path depends on its own inputs only. */
__attribute__((target(BF16_TARGET))) static void rows_avx512_bf16(const mat_t *m, const float *X,
                                                                  int ldx, int n, float *Y,
                                                                  int ldy, int r0, int r1,
                                                                  float *w) {
    int tc = n < SPLIT_TOKENS ? n : SPLIT_TOKENS;
    uint16_t *xb = (uint16_t *)thread_floats(THREAD_BUF_BF16_INPUTS,
                                             (size_t)tc * 64 * bf16_steps(m->cols));
    int t = 0, ok = xb && bf16_row(X, m->cols);
    while (t < n) {
        int u = t + 1, ok_u = 0; /* u: the first token of the next run, ok_u its kind */
        while (u < n && (ok_u = xb && bf16_row(X + (size_t)u * ldx, m->cols)) == ok) u++;
        if (!ok) {
            rows_avx512(m, X + (size_t)t * ldx, ldx, u - t, Y + (size_t)t * ldy, ldy, r0, r1, w);
        } else {
            for (int t0 = t; t0 < u; t0 += tc) {
                int nt = u - t0 < tc ? u - t0 : tc;
                bf16_inputs(X + (size_t)t0 * ldx, ldx, nt, m->cols, xb);
                bf16_rows(m, xb, nt, Y + (size_t)t0 * ldy, ldy, r0, r1, w);
            }
        }
        t = u, ok = ok_u;
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
    return isa >= 3 ? rows_avx512_bf16 : isa == 2 ? rows_avx512 : isa == 1 ? rows_avx2
                                                                          : rows_scalar;
}
