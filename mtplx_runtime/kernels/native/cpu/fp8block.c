/* fp8-block CPU kernels on the stored bytes (FORMAT.md "fp8-block"): the codec hooks fp8_prepare,
 * fp8_rows of the CPU expert library.
 *
 * weight u8 [rows, cols]: one e4m3 byte per weight (bit 7 sign, bits 6..3 exponent e with bias 7,
 * bits 2..0 mantissa m); weight_scale_inv f32 [ceil(rows/128), ceil(cols/128)], one scale per
 * 128 x 128 block. Each weight decodes exactly as formats/fp8block.py decodes it,
 * w = bf16_rne(fp32(e4m3) * s), and the generic row kernels (block_rows.h) multiply; a 64-column
 * decode block lies inside one scale block (64 divides 128), so it reads one scale.
 *
 * e4m3 -> fp32 without a table: for e >= 1 the fp32 bits are (c & 0x7F) << 20 plus 120 << 23
 * (the exponent rebiased from 7 to 127, the mantissa on top of fp32's); for e = 0 the value is
 * m * 2^-9, converted from the integer (no subnormal fp32 operand, which would cost microcode
 * assists); the sign bit moves to bit 31. Paths: scalar, avx2 (8 lanes), avx512 (16 lanes; isa 3
 * runs it too). Scales are checked at prepare (-3); the NaN codes 0x7F and 0xFF decode to NaN and
 * raise the matrix's flag as they are met (the call then returns -4), so a damaged byte never
 * passes as the finite value 480 its bits would otherwise give.
 * Requires cols % 64 == 0 (the driver's block; DeepSeek-V3's 7168 and 2048 are).
 */
#include "lut_decode.h"
#include "nib_split.h"

#define FP8_BLOCK 128 /* rows and columns per scale */

static inline const uint8_t *fp8_bytes(const mat_t *m, int r, int b) {
    return m->packed + (size_t)r * m->row_bytes + (size_t)b * BLOCK;
}

/* The scale of the block holding row r, columns [64b, 64b + 64). */
static inline float fp8_scale(const mat_t *m, int r, int b) {
    float s;
    memcpy(&s, m->scale + (size_t)(r / FP8_BLOCK) * m->scale_row_bytes + 4 * (size_t)(b / 2), 4);
    return s;
}

static inline void raise_flag(const mat_t *m) {
    if (m->flag) __atomic_store_n(m->flag, 1, __ATOMIC_RELAXED);
}

static inline float e4m3_f32(uint8_t c) {
    uint32_t mag = c & 0x7Fu;
    float v = mag >> 3 ? bits_f32((mag << 20) + (120u << 23)) : (float)(mag & 7) * 0x1p-9f;
    return c & 0x80 ? -v : v;
}

static void decode_scalar(const mat_t *m, int r, int b, float *w) {
    const uint8_t *p = fp8_bytes(m, r, b);
    float s = fp8_scale(m, r, b);
    int bad = 0;
    for (int i = 0; i < BLOCK; i++) {
        w[i] = rne_bf16_codec(e4m3_f32(p[i]) * s);
        if ((p[i] & 0x7F) == 0x7F) w[i] = NAN, bad = 1;
    }
    if (bad) raise_flag(m);
}

/* 8 codes (dwords) -> their decoded weights; NaN codes set bits of *bad. */
__attribute__((target("avx2,fma"))) static inline __m256 e4m3_scaled_avx2(__m256i c, __m256 s,
                                                                           int *bad) {
    const __m256i m7f = _mm256_set1_epi32(0x7F);
    __m256i mag = _mm256_and_si256(c, m7f);
    __m256 v = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x78)),
                                     _mm256_setzero_si256());
    __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(7))),
                                 _mm256_set1_ps(0x1p-9f));
    v = _mm256_blendv_ps(v, small, _mm256_castsi256_ps(sub));
    v = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(
                             _mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
    __m256i u = _mm256_castps_si256(_mm256_mul_ps(v, s));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    u = _mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u));
    __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, m7f));
    *bad |= _mm256_movemask_ps(nan);
    return _mm256_blendv_ps(_mm256_castsi256_ps(u), _mm256_set1_ps(NAN), nan);
}

__attribute__((target("avx2,fma"))) static void decode_avx2(const mat_t *m, int r, int b,
                                                            float *w) {
    const uint8_t *p = fp8_bytes(m, r, b);
    __m256 s = _mm256_set1_ps(fp8_scale(m, r, b));
    int bad = 0;
    for (int q = 0; q < BLOCK / 8; q++) {
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * q)));
        _mm256_store_ps(w + 8 * q, e4m3_scaled_avx2(c, s, &bad));
    }
    if (bad) raise_flag(m);
}

/* e4m3_scaled_avx2 on 16 lanes. */
__attribute__((target(AVX512_TARGET))) static inline __m512 e4m3_scaled_avx512(__m512i c,
                                                                                __m512 s,
                                                                                __mmask16 *bad) {
    const __m512i m7f = _mm512_set1_epi32(0x7F);
    __m512i mag = _mm512_and_si512(c, m7f);
    __m512 v = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    __mmask16 sub = _mm512_testn_epi32_mask(c, _mm512_set1_epi32(0x78));
    v = _mm512_mask_mul_ps(v, sub,
                           _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(7))),
                           _mm512_set1_ps(0x1p-9f));
    v = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(v),
        _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24)));
    __m512i u = _mm512_castps_si512(_mm512_mul_ps(v, s));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    u = _mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u));
    __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, m7f);
    *bad |= nan;
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(u), nan, _mm512_set1_ps(NAN));
}

__attribute__((target(AVX512_TARGET))) static void decode_avx512(const mat_t *m, int r, int b,
                                                                 float *w) {
    const uint8_t *p = fp8_bytes(m, r, b);
    __m512 s = _mm512_set1_ps(fp8_scale(m, r, b));
    __mmask16 bad = 0;
    for (int q = 0; q < BLOCK / 16; q++) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * q)));
        _mm512_store_ps(w + 16 * q, e4m3_scaled_avx512(c, s, &bad));
    }
    if (bad) raise_flag(m);
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

__attribute__((target(AVX512_TARGET))) static void rows_avx512(const mat_t *m, const float *X,
                                                               int ldx, int n, float *Y, int ldy,
                                                               int r0, int r1, float *w) {
    rows_tpl_avx512(decode_avx512, m, X, ldx, n, Y, ldy, r0, r1, w);
}

/* ---- avx512 with BW: the decoded values from tables, in split order ----
 * Within a 128 x 128 block a weight's decoded value depends on its code alone, so the kernel
 * builds, per row band (128 rows), one table per 128-column block: the 128 bf16 words
 * bf16(e4m3(c) * s) of the codes c without their sign (0x7F: NaN), 256 bytes, i.e. four zmm
 * registers. 32 codes widen to words, two vpermi2w (64 entries each) and a blend on bit 6 look
 * them up, bit 7 becomes the word's sign (rounding to nearest even is symmetric), and the 32
 * bf16 words give their even columns (word << 16) and odd columns (word & 0xFFFF0000) as fp32:
 * the split order of nib_split.h, whose split_inputs puts the inputs in the same order. Every
 * (row, token) is one chain, 16 lanes, 16 columns a step in that order, then hsum512, in the
 * few-token kernel (fp8_direct) and over decoded blocks (tile_avx512) alike. A NaN code gives a
 * NaN weight, hence a NaN output: only then is the row's bytes scanned for the NaN codes (an
 * input NaN gives a NaN output too, but raises no flag). */

/* The tables of row band `band`: tab[128 j + c] for the band's 128-column blocks j. */
__attribute__((target(AVX512_TARGET))) static void band_tables(const mat_t *m, int band,
                                                               uint16_t *tab) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (size_t j = 0; j < m->scale_row_bytes / 4; j++) {
        float s;
        memcpy(&s, m->scale + (size_t)band * m->scale_row_bytes + 4 * j, 4);
        __mmask16 nan = 0; /* code 0x7F: its NaN stays in the table */
        for (int q = 0; q < 8; q++) {
            __m512 v = e4m3_scaled_avx512(_mm512_add_epi32(lanes, _mm512_set1_epi32(16 * q)),
                                          _mm512_set1_ps(s), &nan);
            _mm256_store_si256((__m256i *)(tab + 128 * j + 16 * q),
                               _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v),
                                                                       16)));
        }
    }
}

/* The bf16 words of 32 codes (words) through the four table registers t. */
__attribute__((target(AVX512_TARGET))) static inline __m512i lookup32(__m512i c,
                                                                      const __m512i t[4]) {
    __m512i lo = _mm512_permutex2var_epi16(t[0], c, t[1]);
    __m512i hi = _mm512_permutex2var_epi16(t[2], c, t[3]);
    __m512i w = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40)), lo,
                                        hi);
    /* w ^ ((c << 8) & 0x8000): the code's sign onto the word */
    return _mm512_ternarylogic_epi32(w, _mm512_slli_epi16(c, 8), _mm512_set1_epi16((short)0x8000),
                                     0x78);
}

/* Row r's bytes hold a NaN code: raise the flag (a NaN output that has none came from X). */
static void check_nan_row(const mat_t *m, int r) {
    const uint8_t *p = m->packed + (size_t)r * m->row_bytes;
    for (int i = 0; i < m->cols; i++)
        if ((p[i] & 0x7F) == 0x7F) {
            raise_flag(m);
            return;
        }
}

/* NR rows from r x TT tokens of the split inputs xs, straight from the bytes. */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
fp8_direct(const mat_t *m, const uint16_t *tab, const float *xs, int ldx, int TT, int NR,
           float *Y, int ldy, int r, const uint8_t *next) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[RB][4];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        prefetch_slice(m, next, b);
        const __m512i *tb = (const __m512i *)(tab + 128 * (b / 2));
        const __m512i t[4] = {_mm512_load_si512(tb), _mm512_load_si512(tb + 1),
                              _mm512_load_si512(tb + 2), _mm512_load_si512(tb + 3)};
        __m512 x[4][4];
        for (int j = 0; j < TT; j++)
            for (int q = 0; q < 4; q++)
                x[j][q] = _mm512_load_ps(xs + (size_t)j * ldx + (size_t)b * BLOCK + 16 * q);
        for (int i = 0; i < NR; i++) {
            const uint8_t *p = fp8_bytes(m, r + i, b);
            for (int h = 0; h < 2; h++) {
                __m512i w = lookup32(
                    _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * h))), t);
                __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(w, high));
                for (int j = 0; j < TT; j++) {
                    acc[i][j] = _mm512_fmadd_ps(we, x[j][2 * h], acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(wo, x[j][2 * h + 1], acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < TT; j++) Y[(size_t)j * ldy + r + i] = hsum512(acc[i][j]);
}

/* Rows [r, r + rb) decoded into w (RB rows of stride ldw) in split order, for tile_avx512. */
__attribute__((target(AVX512_TARGET))) static void fp8_decode_rows(const mat_t *m,
                                                                   const uint16_t *tab, int r,
                                                                   int rb, float *w, int ldw) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int i = 0; i < RB; i++) {
        float *o = w + (size_t)i * ldw;
        if (i >= rb) {
            memset(o, 0, (size_t)m->cols * 4);
            continue;
        }
        const uint8_t *p = m->packed + (size_t)(r + i) * m->row_bytes;
        for (int k = 0; k < m->cols; k += 32) {
            const __m512i *tb = (const __m512i *)(tab + 128 * (k / FP8_BLOCK));
            const __m512i t[4] = {_mm512_load_si512(tb), _mm512_load_si512(tb + 1),
                                  _mm512_load_si512(tb + 2), _mm512_load_si512(tb + 3)};
            __m512i v = lookup32(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + k))),
                                 t);
            _mm512_store_si512(o + k, _mm512_slli_epi32(v, 16));
            _mm512_store_si512(o + k + 16, _mm512_and_si512(v, high));
        }
    }
}

/* Few tokens (TT <= 4, a constant at each call site) over rows [r, r + rb), one band. */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
fp8_few(const mat_t *m, const uint16_t *tab, const float *xs, int ldx, int TT, float *Y, int ldy,
        int r, int rb, const uint8_t *next) {
    if (rb == RB) {
        fp8_direct(m, tab, xs, ldx, TT, RB, Y, ldy, r, next);
        return;
    }
    for (int i = 0; i < rb; i++) fp8_direct(m, tab, xs, ldx, TT, 1, Y, ldy, r + i, NULL);
}

__attribute__((target(AVX512_TARGET))) static void rows_split_avx512(const mat_t *m,
                                                                     const float *X, int ldx,
                                                                     int n, float *Y, int ldy,
                                                                     int r0, int r1, float *w) {
    uint16_t *tab = (uint16_t *)thread_floats(THREAD_BUF_FP8_TABLES, m->scale_row_bytes / 4 * 64);
    int tc = n < SPLIT_TOKENS ? n : SPLIT_TOKENS;
    float *xs = tab ? thread_floats(THREAD_BUF_SPLIT_INPUTS, (size_t)tc * ldx) : NULL;
    if (!xs) { /* out of memory: correct, other summation order */
        rows_avx512(m, X, ldx, n, Y, ldy, r0, r1, w);
        return;
    }
    int ldw = block_stride(m->cols);
    for (int t0 = 0; t0 < n; t0 += tc) {
        int nt = n - t0 < tc ? n - t0 : tc, band = -1;
        float *y = Y + (size_t)t0 * ldy;
        split_inputs(X + (size_t)t0 * ldx, ldx, nt, m->cols, xs);
        for (int r = r0; r < r1;) {
            /* an RB-row block never crosses a band, so it reads one set of tables */
            int rb = r1 - r < RB ? r1 - r : RB;
            if (rb > FP8_BLOCK - r % FP8_BLOCK) rb = FP8_BLOCK - r % FP8_BLOCK;
            if (r / FP8_BLOCK != band) band_tables(m, band = r / FP8_BLOCK, tab);
            const uint8_t *next = next_block(m, r, r1);
            switch (nt) {
            case 1: fp8_few(m, tab, xs, ldx, 1, y, ldy, r, rb, next); break;
            case 2: fp8_few(m, tab, xs, ldx, 2, y, ldy, r, rb, next); break;
            case 3: fp8_few(m, tab, xs, ldx, 3, y, ldy, r, rb, next); break;
            case 4: fp8_few(m, tab, xs, ldx, 4, y, ldy, r, rb, next); break;
            default:
                fp8_decode_rows(m, tab, r, rb, w, ldw);
                tiles_avx512(w, ldw, xs, ldx, nt, m->cols, y, ldy, r, rb);
            }
            for (int i = 0; i < rb; i++)
                for (int t = 0; t < nt; t++)
                    if (y[(size_t)t * ldy + r + i] != y[(size_t)t * ldy + r + i]) {
                        check_nan_row(m, r + i);
                        break;
                    }
            r += rb;
        }
    }
}

int fp8_prepare(mat_t *m) {
    m->row_bytes = (size_t)m->cols;
    m->scale_row_bytes = 4 * (((size_t)m->cols + FP8_BLOCK - 1) / FP8_BLOCK);
    size_t n = ((size_t)m->rows + FP8_BLOCK - 1) / FP8_BLOCK * (m->scale_row_bytes / 4);
    /* formats/fp8block.py check_scales: a scale must be finite and 448 |s| finite in bf16 */
    for (size_t i = 0; i < n; i++) {
        float s;
        memcpy(&s, m->scale + 4 * i, 4);
        if (!isfinite(rne_bf16_codec(448.0f * fabsf(s)))) return -3;
    }
    return 0;
}

rows_fn fp8_rows(const mat_t *m, int isa) {
    (void)m;
    if (isa >= 2) return cpu_has_avx512bw() ? rows_split_avx512 : rows_avx512;
    return isa == 1 ? rows_avx2 : rows_scalar;
}
