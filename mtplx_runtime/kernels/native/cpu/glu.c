/* SiTU-GLU in fp32 from exp and tanh built of fp32 operations only, so that the scalar loop and
 * the AVX-512 loop round identically (the library is built with -ffp-contract=off; every fused
 * multiply-add is written out as fmaf / _mm512_fmadd_ps). libm's tanhf and expf took ~5 % of a
 * t158 decode layer (benchmarks log, "SiTU-GLU without libm"). Accuracy (tests/test_cpu_glu.py):
 * within a few ulp of float64 math, like libm's.
 *
 *   exp(x):  x clamped to [-87, 88] (2^n stays a normal fp32; NaN passes through), n = rint(x
 *            log2 e), r = x - n ln 2 in two steps (Cody-Waite: n * LN2_HI is exact), the
 *            degree-7 Taylor polynomial of e^r on |r| <= ln 2 / 2 (truncation < 6e-9), times 2^n.
 *   tanh(y): |y| < 0.4: y + y z P(z), z = y^2, P the Taylor series of tanh to y^13 (the next
 *            term is < 5e-9 relative); else (t - 1) / (t + 1), t = exp(2 |y|), with y's sign.
 *   SiTU-GLU: ((beta tanh(g / beta)) sigmoid(g)) (beta_lin tanh(u / beta_lin)), sigmoid(g) =
 *            1 / (1 + exp(-g)): the reference's operation order (model/layers.py situ_glu); a
 *            beta of +inf drops its tanh (the limit), which makes SiLU-GLU. */
#include "glu.h"

#include <immintrin.h>
#include <math.h>

#include "cpu_common.h"

#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269502f
#define LN2_HI 0.693359375f      /* 355 / 512: n * LN2_HI is exact for |n| < 2^15 */
#define LN2_LO -2.12194440e-4f   /* ln 2 - LN2_HI */
#define TANH_SMALL 0.4f

/* e^r: 1/k! for k = 7 .. 0, Horner from the top */
static const float EXP_C[8] = {1.98412698e-4f, 1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f,
                               1.66666667e-1f, 0.5f, 1.0f, 1.0f};
/* tanh(y) = y + y z P(z): the series' coefficients of y^13 .. y^3, Horner from the top */
static const float TANH_C[6] = {3.59212804e-3f, -8.86323553e-3f, 2.18694885e-2f,
                                -5.39682540e-2f, 1.33333333e-1f, -3.33333333e-1f};

/* ---- scalar ---- */

static inline __attribute__((always_inline)) float exp_s(float x) {
    x = EXP_HI < x ? EXP_HI : x; /* the operand order of vminps / vmaxps: NaN stays NaN */
    x = EXP_LO > x ? EXP_LO : x;
    if (x != x) return x;
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(-n, LN2_LO, fmaf(-n, LN2_HI, x));
    float p = EXP_C[0];
    for (int k = 1; k < 8; k++) p = fmaf(p, r, EXP_C[k]);
    return p * bits_f32((uint32_t)((int)n + 127) << 23);
}

static inline __attribute__((always_inline)) float tanh_s(float y) {
    float a = fabsf(y);
    if (a < TANH_SMALL) {
        float z = y * y, q = TANH_C[0];
        for (int k = 1; k < 6; k++) q = fmaf(q, z, TANH_C[k]);
        return fmaf(y * z, q, y);
    }
    float t = exp_s(a + a);
    return copysignf((t - 1.0f) / (t + 1.0f), y);
}

/* beta tanh(v / beta), or at beta = +inf its limit v: SiLU-GLU (FORMAT.md "SiLU-GLU") */
static inline __attribute__((always_inline)) float clamp_s(float v, float beta) {
    return isinf(beta) ? v : beta * tanh_s(v / beta);
}

static inline __attribute__((always_inline)) float situ_s(float g, float u, float beta,
                                                            float beta_lin) {
    float sig = 1.0f / (1.0f + exp_s(-g));
    return clamp_s(g, beta) * sig * clamp_s(u, beta_lin);
}

/* ---- AVX-512: the same operations on 16 lanes ---- */

#define GLU_TGT __attribute__((target("avx512f,avx512dq")))

GLU_TGT static inline __m512 exp_v(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(EXP_LO), _mm512_min_ps(_mm512_set1_ps(EXP_HI), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO),
                                _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x));
    __m512 p = _mm512_set1_ps(EXP_C[0]);
    for (int k = 1; k < 8; k++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C[k]));
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    e = _mm512_slli_epi32(e, 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e)); /* NaN lanes: p is NaN */
}

GLU_TGT static inline __m512 tanh_v(__m512 y) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(y)));
    __m512 z = _mm512_mul_ps(y, y), q = _mm512_set1_ps(TANH_C[0]);
    for (int k = 1; k < 6; k++) q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(TANH_C[k]));
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(y, z), q, y);
    __m512 t = exp_v(_mm512_add_ps(a, a)), one = _mm512_set1_ps(1.0f);
    __m512 big = _mm512_div_ps(_mm512_sub_ps(t, one), _mm512_add_ps(t, one));
    big = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(big), _mm512_and_si512(sign, _mm512_castps_si512(y))));
    __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(TANH_SMALL), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(is_small, big, small);
}

/* round_bf16 on 16 lanes: nearest even, NaN kept */
GLU_TGT static inline __m512 round_bf16_v(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(r), f);
}

GLU_TGT static void situ_glu_avx512(const float *g, const float *u, float *h, int n, float beta,
                                    float beta_lin, int round_model) {
    const __m512 b = _mm512_set1_ps(beta), bl = _mm512_set1_ps(beta_lin);
    const __m512 one = _mm512_set1_ps(1.0f);
    const int silu_g = isinf(beta), silu_u = isinf(beta_lin); /* the beta = +inf limit */
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
        if (round_model) gv = round_bf16_v(gv), uv = round_bf16_v(uv);
        __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gv);
        __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_v(neg)));
        __m512 a = silu_g ? gv : _mm512_mul_ps(b, tanh_v(_mm512_div_ps(gv, b)));
        __m512 c = silu_u ? uv : _mm512_mul_ps(bl, tanh_v(_mm512_div_ps(uv, bl)));
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(a, sig), c);
        if (round_model) v = round_bf16_v(v);
        _mm512_mask_storeu_ps(h + i, m, v);
    }
}

/* The scalar loop, once as built and once with FMA enabled (isa 1 has it), where fmaf is one
 * instruction instead of a libm call (0.55 ms against 2.1 ms for a K3 layer's 49,152 values on
 * one thread); fmaf rounds once either way, so the bits are the same. */
#define GLU_SCALAR_LOOP                                                                           \
    for (int i = 0; i < n; i++) {                                                                 \
        float gi = g[i], ui = u[i];                                                               \
        if (round_model) gi = round_bf16(gi), ui = round_bf16(ui);                                \
        float v = situ_s(gi, ui, beta, beta_lin);                                                 \
        h[i] = round_model ? round_bf16(v) : v;                                                   \
    }

static void situ_glu_scalar(const float *g, const float *u, float *h, int n, float beta,
                            float beta_lin, int round_model) {
    GLU_SCALAR_LOOP
}

__attribute__((target("avx2,fma"))) static void situ_glu_fma(const float *g, const float *u,
                                                             float *h, int n, float beta,
                                                             float beta_lin, int round_model) {
    GLU_SCALAR_LOOP
}

void situ_glu_rows(const float *g, const float *u, float *h, int n, float beta, float beta_lin,
                   int round_model, int isa) {
    if (isa >= 2)
        situ_glu_avx512(g, u, h, n, beta, beta_lin, round_model);
    else if (isa == 1)
        situ_glu_fma(g, u, h, n, beta, beta_lin, round_model);
    else
        situ_glu_scalar(g, u, h, n, beta, beta_lin, round_model);
}

int mtplx_cpu_situ_glu(const float *g, const float *u, float *h, int n, float beta,
                       float beta_lin, int round_model) {
    if (n < 0) return -1;
    situ_glu_rows(g, u, h, n, beta, beta_lin, round_model, mtplx_cpu_get_isa());
    return 0;
}
