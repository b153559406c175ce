// Shared device code of the routed-expert kernels (t158_gemv.cu, ctint_gemv.cu, mxfp4_gemv.cu):
// helpers, the codec contract and the decode GEMV templates. The grouped (prefill) templates and
// the MTPLX_KERNELS entry-point macro are in grouped.cuh. Header-only, no system includes, so
// NVRTC (cupy RawModule) and nvcc both compile it with just `-I native`.
//
// Shape legend: T tokens, K experts per token (top-16), R latent (3584), I expert width (3072).
// A record is one expert in a cache slot: gate, up, down components at 4 KiB-aligned offsets
// (FORMAT.md "Streaming artifact"); slot s starts at base + s * slot_bytes.
//
// Pipeline per token:  x [R] --(gate, up rows of each of K slots)--> h [K, I] (SiTU-GLU)
//                      --(down rows)--> y [K, R] --(fp32, ascending k)--> out [R]
// Codec contract (a struct with static members):
//   GROUP                                   columns per scale group (64 or 32)
//   packed_row_bytes(cols), scale_row_bytes(cols)   bytes of one row of each component
//   group(packed_row, scale_row, g, f)      calls f(j, w) for j = 0..GROUP-1 (compile-time
//                                           unrolled), w = Ŵ[64g + j] exactly as the codec's
//                                           reference decodes it (fp32, bf16-representable)
//
// Shared-memory layout of activations (both paths): column c of a staged vector lives at
// c + c / GROUP, i.e. one pad word after every group. Lane L reads group L, so lane addresses
// are (GROUP + 1) * L + j: with GROUP + 1 odd, the 32 lanes hit 32 different banks (unpadded,
// GROUP * L + j puts all 32 lanes in one bank: a 32-way conflict on every load).
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
// (model/layers.py situ_glu; an fp32 island in the reference too). A beta of +inf is the limit
// beta * tanh(v / beta) -> v: SiLU-GLU at both (FORMAT.md "SiLU-GLU").
__device__ __forceinline__ float situ_glu(float g, float u, float beta, float beta_lin) {
  float sig = 1.0f / (1.0f + expf(-g));
  float a = isinf(beta) ? g : beta * tanhf(g / beta);
  return a * sig * (isinf(beta_lin) ? u : beta_lin * tanhf(u / beta_lin));
}

// Padded shared-memory index of column c (see the layout note above).
template <class C>
__device__ __forceinline__ int padded(int c) { return c + c / C::GROUP; }

// This lane's share of row . xs (xs padded): lane L sums groups L, L + 32, ...
template <class C>
__device__ float lane_dot(const u8* packed, const u8* scale, int cols, const float* xs, int lane) {
  float acc = 0.0f;
  for (int g = lane; g < cols / C::GROUP; g += 32) {
    const float* xg = xs + (C::GROUP + 1) * g;  // = padded(GROUP * g)
    C::group(packed, scale, g, [&](int j, float w) { acc += w * xg[j]; });
  }
  return acc;
}

// Decode GEMV, kernel 1: h[t, k, i] = situ_glu(gate_i . x_t, up_i . x_t) for the expert in
// slots[t, k]. grid (ceil(I / WARPS), K, T), block 32 * WARPS, dynamic shared
// padded(R) = R + R / GROUP floats.
// round_model: 1 rounds gate/up outputs and h to bf16 as a bf16 model does.
template <class C>
__device__ void gate_up(const u8* __restrict__ base, long long slot_bytes,
                        const int* __restrict__ slots, const float* __restrict__ x,
                        float* __restrict__ h, int K, int I, int R,
                        long long gate_packed, long long gate_scale,
                        long long up_packed, long long up_scale,
                        float beta, float beta_lin, int round_model) {
  extern __shared__ float xs[];  // [padded(R)]
  const int t = blockIdx.z, k = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int c = threadIdx.x; c < R; c += blockDim.x) xs[padded<C>(c)] = x[(long long)t * R + c];
  __syncthreads();
  const int row = blockIdx.x * MTPLX_WARPS + warp;
  const int slot = slots[t * K + k];
  if (row >= I || slot < 0) return;  // after the only barrier; slot -1: an empty pick
  const u8* rec = base + (long long)slot * slot_bytes;
  const long long pr = (long long)row * C::packed_row_bytes(R);
  const long long sr = (long long)row * C::scale_row_bytes(R);
  float g = warp_sum(lane_dot<C>(rec + gate_packed + pr, rec + gate_scale + sr, R, xs, lane));
  float u = warp_sum(lane_dot<C>(rec + up_packed + pr, rec + up_scale + sr, R, xs, lane));
  if (lane == 0) {
    if (round_model) { g = round_bf16(g); u = round_bf16(u); }
    float v = situ_glu(g, u, beta, beta_lin);
    h[((long long)t * K + k) * I + row] = round_model ? round_bf16(v) : v;
  }
}

// Decode GEMV, kernel 2: out[t, r] = acc0[t, r] (0 when acc0 is null) plus, over k ascending,
// weights[t, k] * (down_r . h[t, k]) in fp32. Multiply then add, never fused, in ascending k
// (= ascending expert id): the combine order of model/moe.py LatentMoE. out may alias acc0 (each
// element is read and written by the same warp). grid (ceil(R / WARPS), T), block 32 * WARPS,
// dynamic shared padded(I) floats.
template <class C>
__device__ void down_combine(const u8* __restrict__ base, long long slot_bytes,
                             const int* __restrict__ slots, const float* __restrict__ h,
                             const float* __restrict__ weights, const float* acc0, float* out,
                             int K, int I, int R, long long down_packed, long long down_scale,
                             int round_model) {
  extern __shared__ float hs[];  // [padded(I)]
  const int t = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * MTPLX_WARPS + warp;
  const long long pr = (long long)row * C::packed_row_bytes(I);
  const long long sr = (long long)row * C::scale_row_bytes(I);
  float acc = (acc0 != nullptr && row < R) ? acc0[(long long)t * R + row] : 0.0f;
  for (int k = 0; k < K; ++k) {
    const int slot = slots[t * K + k];
    if (slot < 0) continue;  // an empty pick adds nothing; uniform over the block (same t, k)
    __syncthreads();  // previous k's hs fully consumed
    for (int c = threadIdx.x; c < I; c += blockDim.x)
      hs[padded<C>(c)] = h[((long long)t * K + k) * I + c];
    __syncthreads();
    if (row < R) {  // no early return: every warp must reach the barriers
      const u8* rec = base + (long long)slot * slot_bytes;
      float y = warp_sum(lane_dot<C>(rec + down_packed + pr, rec + down_scale + sr, I, hs, lane));
      if (round_model) y = round_bf16(y);
      acc = __fadd_rn(acc, __fmul_rn(y, weights[t * K + k]));
    }
  }
  if (row < R && lane == 0) out[(long long)t * R + row] = acc;
}
