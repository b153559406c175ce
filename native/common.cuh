// Shared device code of the routed-expert GEMV kernels (t158_gemv.cu, ctint_gemv.cu,
// mxfp4_gemv.cu). Header-only, no system includes, so NVRTC (cupy RawModule) and nvcc both
// compile it with just `-I native`.
//
// Shape legend: T tokens, K experts per token (top-16), R latent (3584), I expert width (3072).
// A record is one expert in a cache slot: gate, up, down components at 4 KiB-aligned offsets
// (FORMAT.md "Streaming artifact"); slot s starts at base + s * slot_bytes.
//
// Pipeline per token:  x [R] --(gate, up rows of each of K slots)--> h [K, I] (SiTU-GLU)
//                      --(down rows)--> y [K, R] --(fp32, ascending k)--> out [R]
// Codec contract (a struct with static members):
//   packed_row_bytes(cols), scale_row_bytes(cols)   bytes of one row of each component
//   dot(packed_row, scale_row, cols, xs, lane)       this lane's share of row . xs (fp32)
#pragma once

#define MTPLX_WARPS 8  // warps per block: one output row per warp

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf16_bits_to_f32(u32 bits) { return __uint_as_float(bits << 16); }

// fp32 -> nearest bf16 (ties to even) kept in fp32: FORMAT.md's rule, no NaN special case.
__device__ __forceinline__ float round_bf16(float f) {
  u32 u = __float_as_uint(f);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return __uint_as_float(u);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// SiTU(g) * beta_lin * tanh(u / beta_lin), SiTU(g) = beta * tanh(g / beta) * sigmoid(g)
// (model/layers.py situ_glu; an fp32 island in the reference too).
__device__ __forceinline__ float situ_glu(float g, float u, float beta, float beta_lin) {
  float sig = 1.0f / (1.0f + expf(-g));
  return beta * tanhf(g / beta) * sig * (beta_lin * tanhf(u / beta_lin));
}

// h[t, k, i] = situ_glu(gate_i . x_t, up_i . x_t) for the expert in slots[t, k].
// grid (ceil(I / WARPS), K, T), block 32 * WARPS, dynamic shared R floats.
// round_model: 1 rounds gate/up outputs and h to bf16 as a bf16 model does.
template <class C>
__device__ void gate_up(const u8* __restrict__ base, long long slot_bytes,
                        const int* __restrict__ slots, const float* __restrict__ x,
                        float* __restrict__ h, int K, int I, int R,
                        long long gate_packed, long long gate_scale,
                        long long up_packed, long long up_scale,
                        float beta, float beta_lin, int round_model) {
  extern __shared__ float xs[];  // [R]
  const int t = blockIdx.z, k = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int c = threadIdx.x; c < R; c += blockDim.x) xs[c] = x[(long long)t * R + c];
  __syncthreads();
  const int row = blockIdx.x * MTPLX_WARPS + warp;
  if (row >= I) return;  // after the only barrier
  const u8* rec = base + (long long)slots[t * K + k] * slot_bytes;
  const long long pr = (long long)row * C::packed_row_bytes(R);
  const long long sr = (long long)row * C::scale_row_bytes(R);
  float g = warp_sum(C::dot(rec + gate_packed + pr, rec + gate_scale + sr, R, xs, lane));
  float u = warp_sum(C::dot(rec + up_packed + pr, rec + up_scale + sr, R, xs, lane));
  if (lane == 0) {
    if (round_model) { g = round_bf16(g); u = round_bf16(u); }
    float v = situ_glu(g, u, beta, beta_lin);
    h[((long long)t * K + k) * I + row] = round_model ? round_bf16(v) : v;
  }
}

// out[t, r] = sum over k ascending of weights[t, k] * (down_r . h[t, k]) in fp32.
// Multiply then add, never fused, in ascending k (= ascending expert id): the combine order of
// model/moe.py LatentMoE. grid (ceil(R / WARPS), T), block 32 * WARPS, dynamic shared I floats.
template <class C>
__device__ void down_combine(const u8* __restrict__ base, long long slot_bytes,
                             const int* __restrict__ slots, const float* __restrict__ h,
                             const float* __restrict__ weights, float* __restrict__ out,
                             int K, int I, int R, long long down_packed, long long down_scale,
                             int round_model) {
  extern __shared__ float hs[];  // [I]
  const int t = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * MTPLX_WARPS + warp;
  const long long pr = (long long)row * C::packed_row_bytes(I);
  const long long sr = (long long)row * C::scale_row_bytes(I);
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) {
    __syncthreads();  // previous k's hs fully consumed
    for (int c = threadIdx.x; c < I; c += blockDim.x) hs[c] = h[((long long)t * K + k) * I + c];
    __syncthreads();
    if (row < R) {  // no early return: every warp must reach the barriers
      const u8* rec = base + (long long)slots[t * K + k] * slot_bytes;
      float y = warp_sum(C::dot(rec + down_packed + pr, rec + down_scale + sr, I, hs, lane));
      if (round_model) y = round_bf16(y);
      acc = __fadd_rn(acc, __fmul_rn(y, weights[t * K + k]));
    }
  }
  if (row < R && lane == 0) out[(long long)t * R + row] = acc;
}

// One codec's pair of extern "C" entry points, named PREFIX_gate_up and PREFIX_down_combine.
#define MTPLX_KERNELS(PREFIX, CODEC)                                                          \
  extern "C" __global__ void __launch_bounds__(32 * MTPLX_WARPS) PREFIX##_gate_up(            \
      const u8* base, long long slot_bytes, const int* slots, const float* x, float* h,       \
      int K, int I, int R, long long gp, long long gs, long long upk, long long us,            \
      float beta, float beta_lin, int round_model) {                                          \
    gate_up<CODEC>(base, slot_bytes, slots, x, h, K, I, R, gp, gs, upk, us, beta, beta_lin,   \
                   round_model);                                                              \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(32 * MTPLX_WARPS) PREFIX##_down_combine(       \
      const u8* base, long long slot_bytes, const int* slots, const float* h,                 \
      const float* weights, float* out, int K, int I, int R, long long dp, long long ds,      \
      int round_model) {                                                                      \
    down_combine<CODEC>(base, slot_bytes, slots, h, weights, out, K, I, R, dp, ds,            \
                        round_model);                                                         \
  }
