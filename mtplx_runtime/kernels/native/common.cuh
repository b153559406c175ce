// Shared device code of the CUDA kernels (experts: t158.cu, mxfp4.cu, ctint.cu; residents.cu):
// types, bf16 helpers, the few PTX instructions the dequant paths use, the warp MMA, SiTU-GLU.
//
// Header-only with no system includes, so NVRTC (cupy RawModule) and nvcc both compile it with
// just `-I native`. Everything a codec computes per lane is MTPLX_HD: a plain C++ compiler
// builds it too, with exact host emulations of the PTX below (`prmt`, the bf16x2 fma, the MMA),
// so tests/cuda_host/ checks the layouts and the dequant bit for bit without a GPU.
//
// Shape legend: T tokens, K experts per token (top-16), R latent (3584), I expert width (3072).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define MTPLX_CUDA 1
#define MTPLX_HD __host__ __device__ __forceinline__
#else
// Host build (tests/cuda_host): the CUDA qualifiers vanish, the PTX has emulations below.
#include <cmath>
#include <cstring>
#define MTPLX_HD inline
#define __device__
#define __global__
#define __shared__
#define __restrict__
#define __forceinline__ inline
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

MTPLX_HD float bits_f32(u32 u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

MTPLX_HD u32 f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  u32 u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

MTPLX_HD float bf16_bits_to_f32(u32 bits) { return bits_f32(bits << 16); }

// fp32 -> nearest bf16 (ties to even) bits: FORMAT.md's rule, no NaN special case.
MTPLX_HD u32 bf16_rne_bits(float f) {
  const u32 u = f32_bits(f);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// fp32 rounded to bf16, kept in fp32 (where a bf16 model rounds a GEMM output).
MTPLX_HD float round_bf16(float f) { return bits_f32(bf16_rne_bits(f) << 16); }

// PRMT (byte permute): output byte i = byte s_i of the 8-byte value {b:a}, s_i = selector nibble
// i (bits 0-2; bit 3, sign replication, is never used here).
MTPLX_HD u32 prmt(u32 a, u32 b, u32 s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, s);
#else
  const u64 v = ((u64)b << 32) | a;
  u32 r = 0;
  for (int i = 0; i < 4; ++i) r |= (u32)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
#endif
}

#ifndef __CUDA_ARCH__
// Host emulation of one bf16 lane: the exact value rounded once to bf16 (nearest, ties to even,
// subnormals kept, overflow to infinity), as fma.rn.bf16x2 does.
static inline double bf16_lane(u32 bits) { return (double)bf16_bits_to_f32(bits & 0xFFFFu); }
static inline u32 bf16_round_exact(double v) {
  if (v != v) return 0x7FC0u;
  const u32 sign = std::signbit(v) ? 0x8000u : 0u;
  double a = std::fabs(v);
  if (a == 0.0) return sign;
  int ex;
  std::frexp(a, &ex);  // a = f * 2^ex, f in [0.5, 1): the leading bit has weight 2^(ex - 1)
  const int lead = ex - 1 < -126 ? -126 : ex - 1;  // below the normal range: a fixed quantum
  const double quantum = std::ldexp(1.0, lead - 7);
  const double r = std::nearbyint(a / quantum) * quantum;  // ties to even (default mode)
  if (r >= std::ldexp(1.0, 128)) return sign | 0x7F80u;
  return sign | (f32_bits((float)r) >> 16);  // r is a bf16 value: exact in fp32
}
#endif

// d = a * b + c per bf16 lane, rounded once (fma.rn.bf16x2; bf16 subnormals are supported).
MTPLX_HD u32 bf16x2_fma(u32 a, u32 b, u32 c) {
#ifdef __CUDA_ARCH__
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  u32 d = 0;
  for (int h = 0; h < 2; ++h) {
    const double v = bf16_lane(a >> 16 * h) * bf16_lane(b >> 16 * h) + bf16_lane(c >> 16 * h);
    d |= bf16_round_exact(v) << 16 * h;
  }
  return d;
#endif
}

#define MTPLX_BF16X2_ONE 0x3F803F80u      // (1.0, 1.0)
#define MTPLX_BF16X2_NEG_ZERO 0x80008000u  // (-0.0, -0.0): a * b + (-0) is the rounded product

// a * b per lane, rounded once.
MTPLX_HD u32 bf16x2_mul(u32 a, u32 b) { return bf16x2_fma(a, b, MTPLX_BF16X2_NEG_ZERO); }
// a + c per lane, rounded once (exact whenever the sum is a bf16 value).
MTPLX_HD u32 bf16x2_add(u32 a, u32 c) { return bf16x2_fma(a, MTPLX_BF16X2_ONE, c); }
// (v, v): a bf16 pattern in both lanes.
MTPLX_HD u32 bf16x2_splat(u32 bits) { return (bits & 0xFFFFu) * 0x10001u; }

// a * b in fp32, rounded once (never contracted into an fma).
MTPLX_HD float f32_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// (lo, hi) fp32 -> a bf16 pair, each rounded to nearest even (cvt.rn.bf16x2.f32).
MTPLX_HD u32 bf16x2_pack_rn(float lo, float hi) {
#ifdef __CUDA_ARCH__
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return bf16_rne_bits(lo) | bf16_rne_bits(hi) << 16;
#endif
}

// One warp MMA m16n8k16, bf16 inputs, fp32 accumulators: d = a . b + c. Fragment layout (PTX
// ISA, with g = lane / 4 and q = lane % 4; low half of each register = the lower index):
//   a[0] A[g][2q..2q+1]  a[1] A[g+8][2q..2q+1]  a[2] A[g][2q+8..2q+9]  a[3] A[g+8][2q+8..2q+9]
//   b[0] B[2q..2q+1][g]  b[1] B[2q+8..2q+9][g]
//   c[0..1] C[g][2q..2q+1]  c[2..3] C[g+8][2q..2q+1]
// The host emulation (mma_emulate in tests/cuda_host) works on all 32 lanes at once.
#ifdef MTPLX_CUDA
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1,
                                         const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// SiTU(g) * beta_lin * tanh(u / beta_lin), SiTU(g) = beta * tanh(g / beta) * sigmoid(g)
// (FORMAT.md "SiTU-GLU"; an fp32 island in the reference too). A beta of +inf is the limit
// beta * tanh(v / beta) -> v: SiLU-GLU at both (FORMAT.md "SiLU-GLU").
__device__ __forceinline__ float situ_glu(float g, float u, float beta, float beta_lin) {
  const float sig = 1.0f / (1.0f + expf(-g));
  const float a = isinf(beta) ? g : beta * tanhf(g / beta);
  return a * sig * (isinf(beta_lin) ? u : beta_lin * tanhf(u / beta_lin));
}
#endif

// fp32 -> (hi, mid, lo) bf16 with hi + mid + lo = v to within 2^-24 |v| (each remainder is
// exact in fp32): an fp32 operand as three bf16 MMA operands. `parts` 1 keeps hi only (a bf16
// model's operands are bf16 already, so hi == v).
template <int PARTS>
MTPLX_HD void split_bf16(float v, u32 (&out)[PARTS]) {
#pragma unroll
  for (int p = 0; p < PARTS; ++p) {
    const u32 b = bf16_rne_bits(v);
    out[p] = b;
    v -= bf16_bits_to_f32(b);
  }
}
