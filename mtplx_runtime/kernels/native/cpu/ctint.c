/* compressed-tensors int CPU kernels on the packed words (FORMAT.md "ct-int"),
 * symmetric and asymmetric, 3 and 4 bits, group 64 or 32: the codec hooks ctint_prepare,
 * ctint_rows of the CPU expert library.
 *
 * weight_packed i32 [rows, W]: unsigned codes u = q + 2^(b-1) LSB-first. layout 0 "dense":
 * one bit stream per row (4-bit: 8 codes a word; 3-bit: 32 codes in 3 words, codes straddle
 * words), W = cols*b/32. layout 1 "legacy" (3-bit, ct 0.17): 10 codes a word at bits 3(i%10),
 * W = ceil(cols/10); for 4 bits both layouts are the same packing. weight_scale bf16 [rows, G],
 * G = cols / group; weight_zero_point i32 [Wz, G] (asymmetric only) packs the zero point of row
 * r for group g as code r of column g, in the same layout. A 64-column decode block is one group
 * or, at group 32, two: the decoders are templates over `two` (a constant at every call site, so
 * the group-64 kernels are the one-table code they always were) that look each 32-column half
 * up in its own table.
 *
 * Dequant, exactly formats/ctint.py `dequantize`: w = bf16_rne(fp32(q - zp) * fp32(scale)).
 * Per (row, group) the kernel builds that value for each of the 2^b codes and looks codes up in
 * it, so its weights equal the NumPy decode bit for bit. Paths: scalar; avx2 and avx512 decode
 * the dense layout with permutes (4-bit in split order on both: nib_split.h; 3-bit for one token
 * straight into the FMAs on both); the legacy layout decodes with scalar code on every path
 * (checkpoint conversion only) but still multiplies with the path's SIMD dot.
 */
#include "block_rows.h"
#include "lut_decode.h"
#include "nib_split.h"

/* Code idx of a packed stream whose consecutive words are `stride` words apart (1 along a
 * weight row, G down a zero-point column). */
static inline unsigned code_at(const uint8_t *words, size_t stride, long idx, int bits,
                               int legacy) {
    long w = legacy ? idx / 10 : (idx * bits) >> 5;
    int o = legacy ? 3 * (int)(idx % 10) : (int)((idx * bits) & 31);
    uint32_t v = load_u32(words + 4 * (size_t)w * stride) >> o;
    if (o + bits > 32) v |= load_u32(words + 4 * ((size_t)w + 1) * stride) << (32 - o);
    return v & ((1u << bits) - 1);
}

/* Group g's zero code (code offset + zero point: code u decodes from u - zero) and scale; two:
 * groups of 32 (else 64) columns, which the zero points' column count follows. */
static inline __attribute__((always_inline)) void group_params(const mat_t *m, int r, int g,
                                                               int two, int *zero, float *s) {
    int off = 1 << (m->bits - 1);
    *zero = m->zero ? (int)code_at(m->zero + 4 * (size_t)g, m->cols / (two ? 32 : BLOCK), r,
                                   m->bits, m->layout)
                    : off; /* symmetric: zero point 0 */
    uint16_t sbits;
    memcpy(&sbits, m->scale + (size_t)r * m->scale_row_bytes + 2 * (size_t)g, 2);
    *s = bf16f(sbits);
}

/* The zero codes and scales of block b's halves: group b twice, or groups 2b and 2b + 1. */
static inline __attribute__((always_inline)) void block_params(const mat_t *m, int r, int b,
                                                               int two, int zero[2], float s[2]) {
    group_params(m, r, two ? 2 * b : b, two, &zero[0], &s[0]);
    if (two)
        group_params(m, r, 2 * b + 1, two, &zero[1], &s[1]);
    else
        zero[1] = zero[0], s[1] = s[0];
}

/* lut[u] for u < 2^bits: the decoded weight of code u at zero code `zero` and scale s. */
static inline void code_lut(int bits, int zero, float s, float *lut) {
    for (int u = 0; u < 1 << bits; u++) lut[u] = rne_bf16_codec((float)(u - zero) * s);
}

/* The same 16 (or, for 3 bits, first 8) values with vector ops: the same fp32 product and the
 * same integer rounding, hence the same bits. */
__attribute__((target("avx2,fma"))) static inline __m256 lut8_avx2(int first, int zero, float s) {
    __m256i u = _mm256_castps_si256(_mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32(zero - first))),
        _mm256_set1_ps(s)));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* The decoded weight of code codes[l] in each lane l. */
__attribute__((target(AVX512_TARGET))) static inline __m512 lut_avx512(__m512i codes, int zero,
                                                                       float s) {
    __m512i u = _mm512_castps_si512(_mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_sub_epi32(codes, _mm512_set1_epi32(zero))), _mm512_set1_ps(s)));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

__attribute__((target(AVX512_TARGET))) static inline __m512 lut16_avx512(int zero, float s) {
    return lut_avx512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                      zero, s);
}

static inline const uint8_t *block_bytes(const mat_t *m, int r, int b) {
    return m->packed + (size_t)r * m->row_bytes + (size_t)b * BLOCK * m->bits / 8;
}

static inline __attribute__((always_inline)) void
decode_scalar_t(const mat_t *m, int r, int b, float *w, int two) {
    int zero[2];
    float s[2], lut[2][16];
    block_params(m, r, b, two, zero, s);
    code_lut(m->bits, zero[0], s[0], lut[0]);
    if (two) code_lut(m->bits, zero[1], s[1], lut[1]);
    const float *hi = lut[two];
    const uint8_t *p = block_bytes(m, r, b);
    if (m->bits == 4) {
        nib32_scalar(p, lut[0], w);
        nib32_scalar(p + 16, hi, w + 32);
    } else {
        bits3_scalar(p, lut[0], hi, w);
    }
}

static inline __attribute__((always_inline)) void
decode_legacy_t(const mat_t *m, int r, int b, float *w, int two) {
    int zero[2];
    float s[2], lut[2][16];
    block_params(m, r, b, two, zero, s);
    code_lut(3, zero[0], s[0], lut[0]);
    if (two) code_lut(3, zero[1], s[1], lut[1]);
    const uint8_t *row = m->packed + (size_t)r * m->row_bytes;
    for (int i = 0; i < BLOCK; i++)
        w[i] = lut[two && i >= 32][code_at(row, 1, (long)b * BLOCK + i, 3, 1)];
}

/* avx2 tables: lut[h][0] entries 0..7 and lut[h][1] entries 8..15 of half h's. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
lut2_avx2_t(const mat_t *m, int r, int b, __m256 lut[2][2], int two) {
    int zero[2];
    float s[2];
    block_params(m, r, b, two, zero, s);
    lut[0][0] = lut8_avx2(0, zero[0], s[0]);
    lut[0][1] = lut8_avx2(8, zero[0], s[0]);
    lut[1][0] = two ? lut8_avx2(0, zero[1], s[1]) : lut[0][0];
    lut[1][1] = two ? lut8_avx2(8, zero[1], s[1]) : lut[0][1];
}

__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
decode_avx2_t(const mat_t *m, int r, int b, float *w, int two) {
    const uint8_t *p = block_bytes(m, r, b);
    __m256 lut[2][2];
    lut2_avx2_t(m, r, b, lut, two);
    if (m->bits == 4) {
        nib32_avx2(p, lut[0][0], lut[0][1], w);
        nib32_avx2(p + 16, lut[1][0], lut[1][1], w + 32);
    } else {
        bits3_avx2(p, lut[0][0], lut[1][0], w);
    }
}

/* avx512 tables: half h's 16 entries (a 3-bit code reads lanes 0..7). */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
lut2_avx512_t(const mat_t *m, int r, int b, __m512 *lut, int two) {
    int zero[2];
    float s[2];
    block_params(m, r, b, two, zero, s);
    lut[0] = lut16_avx512(zero[0], s[0]);
    lut[1] = two ? lut16_avx512(zero[1], s[1]) : lut[0];
}

/* The decoders and table builders at group 64 (suffix _g64: one table per block) and at group
 * 32 (_g32), as the function pointers the row templates take. */
#define DEC_ARGS const mat_t *m, int r, int b, float *w
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target(AVX512_TARGET)))
static void decode_scalar_g64(DEC_ARGS) { decode_scalar_t(m, r, b, w, 0); }
static void decode_scalar_g32(DEC_ARGS) { decode_scalar_t(m, r, b, w, 1); }
static void decode_legacy_g64(DEC_ARGS) { decode_legacy_t(m, r, b, w, 0); }
static void decode_legacy_g32(DEC_ARGS) { decode_legacy_t(m, r, b, w, 1); }
AVX2 static void decode_avx2_g64(DEC_ARGS) { decode_avx2_t(m, r, b, w, 0); }
AVX2 static void decode_avx2_g32(DEC_ARGS) { decode_avx2_t(m, r, b, w, 1); }
AVX2 static inline void lut2_avx2_g64(const mat_t *m, int r, int b, __m256 lut[2][2]) {
    lut2_avx2_t(m, r, b, lut, 0);
}
AVX2 static inline void lut2_avx2_g32(const mat_t *m, int r, int b, __m256 lut[2][2]) {
    lut2_avx2_t(m, r, b, lut, 1);
}
AVX512 static inline void lut2_avx512_g64(const mat_t *m, int r, int b, __m512 *lut) {
    lut2_avx512_t(m, r, b, lut, 0);
}
AVX512 static inline void lut2_avx512_g32(const mat_t *m, int r, int b, __m512 *lut) {
    lut2_avx512_t(m, r, b, lut, 1);
}
/* avx512, 3 bits (4 bits: decode_split_avx512) */
AVX512 static inline __attribute__((always_inline)) void decode3_avx512_t(DEC_ARGS, int two) {
    __m512 lut[2];
    lut2_avx512_t(m, r, b, lut, two);
    bits3_avx512(block_bytes(m, r, b), lut[0], lut[1], w);
}
AVX512 static void decode3_avx512_g64(DEC_ARGS) { decode3_avx512_t(m, r, b, w, 0); }
AVX512 static void decode3_avx512_g32(DEC_ARGS) { decode3_avx512_t(m, r, b, w, 1); }
/* avx512 and avx2, 4 bits: split order (nib_split.h) */
AVX512 static void decode_split_avx512_g64(DEC_ARGS) { split_decode(lut2_avx512_g64, m, r, b, w); }
AVX512 static void decode_split_avx512_g32(DEC_ARGS) { split_decode(lut2_avx512_g32, m, r, b, w); }
AVX2 static void decode_split_avx2_g64(DEC_ARGS) { split_decode_avx2(lut2_avx2_g64, m, r, b, w); }
AVX2 static void decode_split_avx2_g32(DEC_ARGS) { split_decode_avx2(lut2_avx2_g32, m, r, b, w); }

/* The row kernels, instantiated below at group 64 (suffix _g64) and at group 32 (_g32). */
#define ROWS_ARGS                                                                                  \
    const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy, int r0, int r1, float *w
#define ROWS_PASS m, X, ldx, n, Y, ldy, r0, r1, w

/* avx2, 3 bits, one token: NR rows from r with the codes going straight from the packed bytes
 * into the FMAs (bits3_avx2's lookups, no decoded block in memory), 8 columns a step in natural
 * order: the chains of rows_tpl_avx2, so the same bits as a call with more tokens. The next
 * row block is prefetched as block_rows.h's few-token kernels do. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
direct3_avx2(const mat_t *m, const float *x, int NR, float *y, int r, const uint8_t *next,
             int two) {
    const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), m7 = _mm256_set1_epi32(7);
    __m256 acc[RB];
    for (int i = 0; i < NR; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        prefetch_slice(m, next, b);
        for (int i = 0; i < NR; i++) {
            int zero[2];
            float s[2];
            block_params(m, r + i, b, two, zero, s);
            __m256 lo = lut8_avx2(0, zero[0], s[0]), hi = two ? lut8_avx2(0, zero[1], s[1]) : lo;
            const uint8_t *p = block_bytes(m, r + i, b);
            uint64_t q[3] = {load_u64(p), load_u64(p + 8), load_u64(p + 16)};
            for (int c = 0; c < 4; c++) {
                uint64_t v = trit3_chunk(q, c);
                for (int h = 0; h < 2; h++) {
                    __m256i idx = _mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32((int)((v >> (24 * h)) & 0xFFFFFF)),
                                          sh), m7);
                    acc[i] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(c < 2 ? lo : hi, idx),
                                             _mm256_load_ps(x + (size_t)b * BLOCK + 16 * c + 8 * h),
                                             acc[i]);
                }
            }
        }
    }
    for (int i = 0; i < NR; i++) y[r + i] = hsum256(acc[i]);
}

__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
rows3_avx2_t(ROWS_ARGS, decode_fn dec, int two) {
    if (n > 1) {
        rows_tpl_avx2(dec, ROWS_PASS);
        return;
    }
    int r = r0;
    for (; r + RB <= r1; r += RB) direct3_avx2(m, X, RB, Y, r, next_block(m, r, r1), two);
    for (; r < r1; r++) direct3_avx2(m, X, 1, Y, r, NULL, two);
}

/* avx512, 3 bits, one token: direct3_avx2's idea at 16 lanes, with the codes spread by byte
 * shuffles instead of scalar shifts and broadcasts. Chunk c (codes 16c..16c+15, bits 48c..)
 * is read as the u64 at byte 6c (byte 16 for c = 3, so no read passes the group's 24 bytes)
 * broadcast to every 128-bit lane; lane dword j takes the two bytes holding code j's bits and
 * shifts them down. Bits 3 and up of an index are the next code's (or another byte's): the
 * table repeats its 8 values in lanes 8..15 and vpermps reads bits 0..3 only, so no mask. */
__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
direct3_avx512(const mat_t *m, const float *x, int NR, float *y, int r, const uint8_t *next,
               const __m512i ctl[2], const __m512i sh[2], int two) {
    const __m512i codes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 acc[RB];
    for (int i = 0; i < NR; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < m->cols / BLOCK; b++) {
        prefetch_slice(m, next, b);
        __m512 xv[4];
        for (int c = 0; c < 4; c++) xv[c] = _mm512_load_ps(x + (size_t)b * BLOCK + 16 * c);
        for (int i = 0; i < NR; i++) {
            int zero[2];
            float s[2];
            block_params(m, r + i, b, two, zero, s);
            __m512 lo = lut_avx512(codes, zero[0], s[0]);
            __m512 hi = two ? lut_avx512(codes, zero[1], s[1]) : lo;
            const uint8_t *p = block_bytes(m, r + i, b);
            for (int c = 0; c < 4; c++) {
                __m512i q = _mm512_set1_epi64((long long)load_u64(p + (c < 3 ? 6 * c : 16)));
                __m512i idx = _mm512_srlv_epi32(_mm512_shuffle_epi8(q, ctl[c == 3]), sh[c == 3]);
                acc[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, c < 2 ? lo : hi), xv[c],
                                         acc[i]);
            }
        }
    }
    for (int i = 0; i < NR; i++) y[r + i] = hsum512(acc[i]);
}

__attribute__((target(AVX512_TARGET))) static inline __attribute__((always_inline)) void
rows3_avx512_t(ROWS_ARGS, decode_fn dec, int two) {
    if (n > 1) {
        rows_tpl_avx512(dec, ROWS_PASS);
        return;
    }
    /* per dword j: bytes (3j + d) / 8 and the next of the u64, shifted by (3j + d) % 8; d = 0,
     * or 16 for chunk 3's u64 (read at byte 16 instead of 18) */
    const __m512i j3 = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39, 42,
                                         45);
    __m512i ctl[2], sh[2];
    for (int k = 0; k < 2; k++) {
        __m512i pos = _mm512_add_epi32(j3, _mm512_set1_epi32(16 * k));
        __m512i b0 = _mm512_srli_epi32(pos, 3);
        ctl[k] = _mm512_or_si512(b0, _mm512_slli_epi32(_mm512_add_epi32(b0, _mm512_set1_epi32(1)),
                                                       8));
        sh[k] = _mm512_and_si512(pos, _mm512_set1_epi32(7));
    }
    int r = r0;
    for (; r + RB <= r1; r += RB)
        direct3_avx512(m, X, RB, Y, r, next_block(m, r, r1), ctl, sh, two);
    for (; r < r1; r++) direct3_avx512(m, X, 1, Y, r, NULL, ctl, sh, two);
}

/* One set of row kernels per group size: SUF the function suffix, TWO the constant. The 4-bit
 * split kernels fall back to rows_avx2 (natural order) when out of memory. */
#define CTINT_ROWS(SUF, TWO)                                                                       \
    static void rows_scalar##SUF(ROWS_ARGS) { rows_tpl_scalar(decode_scalar##SUF, ROWS_PASS); }    \
    static void rows_legacy_scalar##SUF(ROWS_ARGS) {                                               \
        rows_tpl_scalar(decode_legacy##SUF, ROWS_PASS);                                            \
    }                                                                                              \
    AVX2 static void rows_avx2##SUF(ROWS_ARGS) {                                                   \
        rows_tpl_avx2(decode_avx2##SUF, ROWS_PASS);                                                \
    }                                                                                              \
    AVX2 static void rows3_avx2##SUF(ROWS_ARGS) {                                                  \
        rows3_avx2_t(ROWS_PASS, decode_avx2##SUF, TWO);                                            \
    }                                                                                              \
    AVX2 static void rows4_avx2##SUF(ROWS_ARGS) {                                                  \
        split_rows_avx2(lut2_avx2##SUF, decode_split_avx2##SUF, rows_avx2##SUF, ROWS_PASS);        \
    }                                                                                              \
    AVX2 static void rows_legacy_avx2##SUF(ROWS_ARGS) {                                            \
        rows_tpl_avx2(decode_legacy##SUF, ROWS_PASS);                                              \
    }                                                                                              \
    AVX512 static void rows3_avx512##SUF(ROWS_ARGS) {                                              \
        rows3_avx512_t(ROWS_PASS, decode3_avx512##SUF, TWO);                                       \
    }                                                                                              \
    AVX512 static void rows4_avx512##SUF(ROWS_ARGS) {                                              \
        split_rows(lut2_avx512##SUF, decode_split_avx512##SUF, rows_avx2##SUF, ROWS_PASS);         \
    }                                                                                              \
    AVX512 static void rows_legacy_avx512##SUF(ROWS_ARGS) {                                        \
        rows_tpl_avx512(decode_legacy##SUF, ROWS_PASS);                                            \
    }                                                                                              \
    static rows_fn ctint_rows##SUF(const mat_t *m, int isa) {                                      \
        if (m->layout)                                                                             \
            return isa >= 2   ? rows_legacy_avx512##SUF                                            \
                   : isa == 1 ? rows_legacy_avx2##SUF                                              \
                              : rows_legacy_scalar##SUF;                                           \
        if (isa >= 2) return m->bits == 4 ? rows4_avx512##SUF : rows3_avx512##SUF;                 \
        if (isa == 1) return m->bits == 4 ? rows4_avx2##SUF : rows3_avx2##SUF;                     \
        return rows_scalar##SUF;                                                                   \
    }

CTINT_ROWS(_g64, 0)
CTINT_ROWS(_g32, 1)

int ctint_prepare(mat_t *m) {
    if ((m->bits != 3 && m->bits != 4) || (m->layout != 0 && m->layout != 1) ||
        (m->group != 32 && m->group != BLOCK))
        return -1;
    if (m->bits == 4) m->layout = 0; /* 4-bit packing is the same in both layouts */
    size_t words = m->layout ? ((size_t)m->cols + 9) / 10 : (size_t)m->cols * m->bits / 32;
    m->row_bytes = 4 * words;
    m->scale_row_bytes = 2 * ((size_t)m->cols / m->group);
    return 0;
}

rows_fn ctint_rows(const mat_t *m, int isa) {
    return m->group == 32 ? ctint_rows_g32(m, isa) : ctint_rows_g64(m, isa);
}
