/* mxfp4 CPU kernels on the packed bytes (FORMAT.md "mxfp4"): the codec hooks mxfp4_prepare,
 * mxfp4_rows of the CPU expert library.
 *
 * Row r of a [rows, cols] matrix: weight_packed u8 [rows, cols/2] (byte j: column 2j in the low
 * nibble, 2j+1 in the high; nibble = E2M1, bit 3 the sign) and weight_scale u8 [rows, cols/32]
 * (E8M0 e: 2^(e-127), e = 0 is the subnormal 2^-127, 0xFF is rejected with -3 as the NumPy
 * decoder rejects it). Per 32-column group the kernel builds the 16 decoded values
 * E2M1[nibble] * 2^(e-127) in fp32, exactly formats/mxfp4.py's `values * scale`, and looks the
 * nibbles up in it. Paths: scalar, avx2 (two 8-entry permutes), avx512 (one 16-entry permute,
 * columns in split order: nib_split.h).
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
    split_rows(lut2_avx512, decode_split_avx512, rows_avx2, m, X, ldx, n, Y, ldy, r0, r1, w);
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
