/* What the sources of the CPU expert library share: the matrix descriptor, the row-kernel and
 * decoder signatures, the codec hooks (one pair per codec source, collected in expert.c's codec
 * table), the per-thread scratch size, and small inline numeric and SIMD helpers. */
#ifndef MTPLX_CPU_COMMON_H
#define MTPLX_CPU_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mtplx_cpu.h"

#define BLOCK 64       /* columns per decode block: every codec's group size divides it */
#define XPAD 16        /* zero floats after each input row: t158's SIMD paths read 8 past it */
#define RB 4           /* rows per decoded block of the generic row kernels (block_rows.h) */
#define AVX512_TARGET "avx512f,avx512dq,avx512bw,avx2,fma"
/* isa 3: AVX-512 with BF16 dot products (mxfp4's bf16-input path). */
#define BF16_TARGET AVX512_TARGET ",avx512bf16"

/* One quantized matrix [rows, cols] as the codec stores it (pointers into record bytes). */
typedef struct {
    const uint8_t *packed, *scale, *zero; /* zero: ct-int-asym zero points, else NULL */
    int rows, cols, bits, layout;         /* bits, layout: ct-int only (layout 1 = legacy 3-bit) */
    size_t row_bytes, scale_row_bytes;    /* filled in by the codec's prepare hook */
    int codec;                            /* enum mtplx_codec */
    int *flag; /* set (atomically) by a decoder that meets an invalid code: fp8-block NaN */
    int group; /* ct-int: columns per scale, 64 or 32 (the others' groups are fixed) */
} mat_t;

/* Y[t*ldy + r] = row r of m · X[t*ldx ...] for t < n, r in [r0, r1). `scratch` holds
 * scratch_floats(m->cols) floats, 64-byte aligned, private to the calling thread. */
typedef void (*rows_fn)(const mat_t *m, const float *X, int ldx, int n, float *Y, int ldy,
                        int r0, int r1, float *scratch);
/* The exact decoded weights of columns [64b, 64b + 64) of row r into w (64-byte aligned). */
typedef void (*decode_fn)(const mat_t *m, int r, int b, float *w);

/* Codec hooks. <codec>_prepare checks bits/layout/shape and fills the row strides (0, or a
 * negative return code); <codec>_rows picks the row kernel for an ISA (0 scalar, 1 avx2,
 * 2 avx512, 3 avx512bf16: only mxfp4 has a kernel of its own there, the others run their 2). */
int t158_prepare(mat_t *m);
rows_fn t158_rows(const mat_t *m, int isa);

/* A codec's optional input stage: what its row kernel derives from an input row (t158 on
 * avx512: the tables), built once and handed to every matrix and row chunk that reads that
 * input. floats(m, n, isa): the floats n input rows take, 0 where the stage does not apply (use
 * rows_fn); build(m, X, ldx, n, prep) fills them; rows computes rows [r0, r1) like rows_fn from
 * them. m is any matrix with the input's column count. */
typedef struct {
    size_t (*floats)(const mat_t *m, int n, int isa);
    void (*build)(const mat_t *m, const float *X, int ldx, int n, float *prep);
    void (*rows)(const mat_t *m, const float *prep, int n, float *Y, int ldy, int r0, int r1,
                 float *scratch);
} input_stage;
extern const input_stage T158_INPUT;
int mxfp4_prepare(mat_t *m);
rows_fn mxfp4_rows(const mat_t *m, int isa);
int ctint_prepare(mat_t *m);
rows_fn ctint_rows(const mat_t *m, int isa);
int fp8_prepare(mat_t *m);
rows_fn fp8_rows(const mat_t *m, int isa);
/* Whether the CPU has AVX-512 BW (16-bit lanes), which isa 2 (F and DQ) does not imply: the
 * kernels that need it (t158's t16f, fp8-block's tables) ask before they are chosen (isa.c). */
int cpu_has_avx512bw(void);

/* This thread's buffer `slot` with room for `floats` (64-byte aligned, contents unspecified,
 * kept across calls, freed at thread exit; thread_buf.c), or NULL when out of memory. */
enum {
    THREAD_BUF_T158_TABLES,
    THREAD_BUF_SPLIT_INPUTS,
    THREAD_BUF_BF16_INPUTS,
    THREAD_BUF_ROW_SCRATCH, /* the expert pipeline's row-kernel scratch (expert.c) */
    THREAD_BUF_STAGE_IN,    /* its input stage of x (gate and up) */
    THREAD_BUF_STAGE_DOWN,  /* its input stage of h (down) */
    THREAD_BUF_PIPE_SETS,   /* its buffer sets (the calling thread's) */
    THREAD_BUF_FP8_TABLES,  /* fp8-block's decoded-value tables of one row band */
    THREAD_BUF_SLOTS
};
float *thread_floats(int slot, size_t floats);

/* One decoded row block of the generic kernels: the stride cols + 16 keeps the RB rows off a
 * 4 KiB multiple so they do not alias in L1. */
static inline int block_stride(int cols) { return cols + 16; }
/* The per-thread scratch every row kernel may use, in floats. */
static inline size_t scratch_floats(int cols) { return (size_t)RB * block_stride(cols); }

/* ---- small numeric helpers ---- */

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bf16f(uint16_t u) { return bits_f32((uint32_t)u << 16); }

/* fp32 -> nearest-even bf16 -> fp32, the formula of formats/base.py f32_to_bf16_bits (no NaN
 * case): used where the codec itself rounds (ct-int dequant), so the weights match bit for bit. */
static inline float rne_bf16_codec(float f) {
    uint32_t u = f32_bits(f);
    return bits_f32((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

/* What torch's float -> bfloat16 cast does (nearest even, NaN kept NaN): model rounding. */
static inline float round_bf16(float f) {
    if (f != f) return f;
    return rne_bf16_codec(f);
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4); /* record bytes carry no alignment promise */
    return v;
}

static inline uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* ---- horizontal sums (per-function targets: one portable build, paths picked at run time) */

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

__attribute__((target(AVX512_TARGET))) static inline float hsum512(__m512 v) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

#endif
