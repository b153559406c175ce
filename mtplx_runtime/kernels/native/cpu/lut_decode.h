/* Table decoders shared by mxfp4.c and ctint.c: codes are indexes into a small
 * per-group table of the exact decoded weights (built by the codec once per group), so one
 * decode step serves every code value and the result is the codec's value bit for bit.
 *
 * Nibble streams (mxfp4, ct-int 4-bit): byte j holds code 2j in its low and 2j+1 in its high
 * nibble (ct-int 4-bit words are 8 nibbles LSB-first, which is the same byte order); on AVX2
 * and AVX-512 they are decoded in split order instead (nib_split.h), these natural-order
 * decoders serving the scalar path and the out-of-memory fallback.
 * 3-bit streams (ct-int dense): code i at bits 3i..3i+2 of a little-endian bit stream; a
 * 64-code block is 24 bytes, read as three u64 so no code needs a straddle test. Their decoders
 * take one table per 32-code half, lo and hi (ct-int's groups of 32; the same one twice for 64).
 */
#ifndef MTPLX_LUT_DECODE_H
#define MTPLX_LUT_DECODE_H

#include "cpu_common.h"

/* 32 nibble codes of p[0..16) through lut[16]. */
static inline void nib32_scalar(const uint8_t *p, const float *lut, float *w) {
    for (int j = 0; j < 16; j++) {
        w[2 * j] = lut[p[j] & 15];
        w[2 * j + 1] = lut[p[j] >> 4];
    }
}

/* The 48-bit chunk c (codes 16c..16c+15) of a 3-bit block held in q[3]. */
static inline uint64_t trit3_chunk(const uint64_t q[3], int c) {
    switch (c) {
    case 0: return q[0];
    case 1: return (q[0] >> 48) | (q[1] << 16);
    case 2: return (q[1] >> 32) | (q[2] << 32);
    default: return q[2] >> 16;
    }
}

/* 64 3-bit codes of p[0..24) through lo[8] (codes 0..31) and hi[8] (codes 32..63). */
static inline void bits3_scalar(const uint8_t *p, const float *lo, const float *hi, float *w) {
    uint64_t q[3] = {load_u64(p), load_u64(p + 8), load_u64(p + 16)};
    for (int c = 0; c < 4; c++) {
        uint64_t v = trit3_chunk(q, c);
        const float *lut = c < 2 ? lo : hi;
        for (int i = 0; i < 16; i++) w[16 * c + i] = lut[(v >> (3 * i)) & 7];
    }
}

/* AVX2: a 16-entry table is two 8-float registers; permutevar8x32 reads index bits 0..2 and
 * bit 3 (moved to the sign bit) picks the register. */
__attribute__((target("avx2,fma"))) static inline __m256 lut16_avx2(__m256i idx, __m256 lo,
                                                                     __m256 hi) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* 32 nibble codes of p[0..16): each byte is duplicated into two lanes, shifted by 0 and 4. */
__attribute__((target("avx2,fma"))) static inline void nib32_avx2(const uint8_t *p, __m256 lo,
                                                                   __m256 hi, float *w) {
    const __m256i dup_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i dup_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const __m256i sh = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), m = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
        __m256i a = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(v, dup_lo),
                                                       sh), m);
        __m256i b = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(v, dup_hi),
                                                       sh), m);
        _mm256_store_ps(w + 16 * h, lut16_avx2(a, lo, hi));
        _mm256_store_ps(w + 16 * h + 8, lut16_avx2(b, lo, hi));
    }
}

/* 64 3-bit codes of p[0..24) through an 8-float table per half (lo: codes 0..31, hi: 32..63): 8
 * codes (24 bits) per broadcast. */
__attribute__((target("avx2,fma"))) static inline void bits3_avx2(const uint8_t *p, __m256 lo,
                                                                   __m256 hi, float *w) {
    const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), m = _mm256_set1_epi32(7);
    uint64_t q[3] = {load_u64(p), load_u64(p + 8), load_u64(p + 16)};
    for (int c = 0; c < 4; c++) {
        uint64_t v = trit3_chunk(q, c);
        for (int h = 0; h < 2; h++) {
            __m256i idx = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32((int)((v >> (24 * h)) & 0xFFFFFF)), sh), m);
            _mm256_store_ps(w + 16 * c + 8 * h, _mm256_permutevar8x32_ps(c < 2 ? lo : hi, idx));
        }
    }
}

/* 64 3-bit codes of p[0..24) through an 8-entry table per half (lanes 0..7 of lo: codes 0..31,
 * of hi: 32..63): 16 codes per step, lanes 0..7 from the chunk's low 24 bits and lanes 8..15 from
 * its high 24. */
__attribute__((target(AVX512_TARGET))) static inline void bits3_avx512(const uint8_t *p,
                                                                        __m512 lo, __m512 hi,
                                                                        float *w) {
    const __m512i sh = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
    const __m512i m = _mm512_set1_epi32(7);
    uint64_t q[3] = {load_u64(p), load_u64(p + 8), load_u64(p + 16)};
    for (int c = 0; c < 4; c++) {
        uint64_t v = trit3_chunk(q, c);
        __m512i both = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32((int)(v & 0xFFFFFF)),
                                               _mm512_set1_epi32((int)((v >> 24) & 0xFFFFFF)));
        __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(both, sh), m);
        _mm512_store_ps(w + 16 * c, _mm512_permutexvar_ps(idx, c < 2 ? lo : hi));
    }
}

#endif
