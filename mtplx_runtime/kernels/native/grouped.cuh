// Grouped routed-expert kernels for prefill chunks (T > 1), and the entry-point macro.
//
// The host (mtplx_runtime/kernels/cuda.py group_pairs) sorts the T*K (token, k) pairs by
// slot: `pairs` lists pair ids p = t * K + k grouped by slot, and cuts each slot's run into tiles
// of at most MTPLX_TILE pairs: tile i covers pairs[tile_start[i] .. + tile_count[i]), all of
// expert slot tile_slot[i]. One block handles one (row block, tile): every weight of its rows is
// decoded once and applied to all the tile's pairs (the decode GEMV decodes it once per pair).
//
//   gate_up_grouped: x [T, R] -> h [T*K, I]  (row p of h = pair p; input row = token p / K)
//   down_grouped:    h [T*K, I] -> y [T*K, R]  (rounded to bf16 where a bf16 model rounds)
//   mtplx_combine:   out[t] = acc0[t] (or 0) + sum over k ascending of weights[t, k] * y[t*K + k]
//
// Staging: the tile's inputs are staged in shared memory one chunk of 32 groups at a time (so
// lane L always works on group L of the chunk): xs4[padded(c)] is a float4 holding column c of
// the tile's 4 input vectors (.x = pair 0 ... .w = pair 3; zeros past tile_count). One 16-byte
// load then feeds 4 FMAs, and the padding keeps each quarter-warp's 16-byte loads in distinct
// banks ((GROUP + 1) * L is L mod 8 in 16-byte units). Shared bytes: 32 * (GROUP + 1) * 16 =
// 33,280 (GROUP 64) or 16,896 (GROUP 32), under the 48 KiB default for any R and I.
#pragma once
#include "common.cuh"

#define MTPLX_TILE 4  // pairs per tile: one float4 of staged input per column
// Min resident blocks per SM for the grouped kernels: caps registers at 65536 / (2 * 256) = 128
// (unbounded, nvcc keeps all 32 float4 of an mxfp4 group live: 162 registers, 1 block per SM).
#define MTPLX_GROUPED_MIN_BLOCKS 2

// acc[m][t] = (row of matrix m) . (input vector of the tile's pair t), summed over the warp (every
// lane gets the total), for the NM (1: down, 2: gate and up) matrices whose row starts at
// rec + packed[m] + row * packed_row_bytes(cols). Input vector of pair p: in[(p / in_div) * cols
// ...]. All threads of the block must call it (barriers inside); warps whose row >= rows stage
// inputs but compute nothing.
template <class C, int NM>
__device__ void tile_dots(const u8* __restrict__ rec, const long long (&packed)[NM],
                          const long long (&scale)[NM], int row, int rows, int cols,
                          const float* __restrict__ in, int in_div, const int* __restrict__ tp,
                          int n, float (&acc)[NM][MTPLX_TILE]) {
  static_assert(NM == 1 || NM == 2, "down alone, or gate and up");
  extern __shared__ float4 xs4[];  // [32 * (GROUP + 1)]
  float* xs = reinterpret_cast<float*>(xs4);
  const int lane = threadIdx.x & 31, G = cols / C::GROUP;
  const long long pr = (long long)row * C::packed_row_bytes(cols);
  const long long sr = (long long)row * C::scale_row_bytes(cols);
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int t = 0; t < MTPLX_TILE; ++t) acc[m][t] = 0.0f;
  for (int g0 = 0; g0 < G; g0 += 32) {
    const int cw = min(32, G - g0) * C::GROUP;  // columns staged for this chunk
    __syncthreads();                            // previous chunk fully consumed
    // Thread i stages column c of pair t: consecutive threads read consecutive columns (coalesced).
    for (int i = threadIdx.x; i < MTPLX_TILE * cw; i += blockDim.x) {
      const int t = i / cw, c = i - t * cw;
      xs[4 * padded<C>(c) + t] =
          t < n ? in[(long long)(tp[t] / in_div) * cols + (long long)g0 * C::GROUP + c] : 0.0f;
    }
    __syncthreads();
    const int g = g0 + lane;
    if (row < rows && g < G) {
      const float4* xg = xs4 + (C::GROUP + 1) * lane;  // = padded(GROUP * lane)
      // With two matrices, decode matrix 0's group into registers first, then walk matrix 1 and
      // feed each staged float4 to both: one shared load per column for gate and up. (Two
      // independent passes let nvcc keep all of a group's float4 loads live across them: 162
      // registers for mxfp4.)
      float w0[NM == 2 ? C::GROUP : 1];
      if constexpr (NM == 2) C::group(rec + packed[0] + pr, rec + scale[0] + sr, g,
                                      [&](int j, float w) { w0[j] = w; });
      C::group(rec + packed[NM - 1] + pr, rec + scale[NM - 1] + sr, g, [&](int j, float w) {
        const float4 v = xg[j];
        if constexpr (NM == 2) {
          acc[0][0] += w0[j] * v.x;
          acc[0][1] += w0[j] * v.y;
          acc[0][2] += w0[j] * v.z;
          acc[0][3] += w0[j] * v.w;
        }
        acc[NM - 1][0] += w * v.x;
        acc[NM - 1][1] += w * v.y;
        acc[NM - 1][2] += w * v.z;
        acc[NM - 1][3] += w * v.w;
      });
    }
  }
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int t = 0; t < MTPLX_TILE; ++t) acc[m][t] = warp_sum(acc[m][t]);
}

// h[p, i] = situ_glu(gate_i . x_{p / K}, up_i . x_{p / K}) for every pair p of tile blockIdx.y.
// grid (ceil(I / WARPS), n_tiles), block 32 * WARPS, dynamic shared 32 * (GROUP + 1) float4.
template <class C>
__device__ void gate_up_grouped(const u8* __restrict__ base, long long slot_bytes,
                                const int* __restrict__ tile_slot, const int* __restrict__ tile_start,
                                const int* __restrict__ tile_count, const int* __restrict__ pairs,
                                const float* __restrict__ x, float* __restrict__ h, int K, int I,
                                int R, long long gate_packed, long long gate_scale,
                                long long up_packed, long long up_scale, float beta,
                                float beta_lin, int round_model) {
  const int tile = blockIdx.y, n = tile_count[tile];
  const int* tp = pairs + tile_start[tile];
  const u8* rec = base + (long long)tile_slot[tile] * slot_bytes;
  const int row = blockIdx.x * MTPLX_WARPS + (threadIdx.x >> 5);
  const long long packed[2] = {gate_packed, up_packed}, scale[2] = {gate_scale, up_scale};
  float acc[2][MTPLX_TILE];
  tile_dots<C, 2>(rec, packed, scale, row, I, R, x, K, tp, n, acc);
  if (row >= I || (threadIdx.x & 31) != 0) return;
#pragma unroll
  for (int t = 0; t < MTPLX_TILE; ++t) {
    if (t < n) {
      float g = acc[0][t], u = acc[1][t];
      if (round_model) { g = round_bf16(g); u = round_bf16(u); }
      const float v = situ_glu(g, u, beta, beta_lin);
      h[(long long)tp[t] * I + row] = round_model ? round_bf16(v) : v;
    }
  }
}

// y[p, r] = down_r . h[p] for every pair p of tile blockIdx.y (bf16-rounded when round_model).
// grid (ceil(R / WARPS), n_tiles), block 32 * WARPS, dynamic shared 32 * (GROUP + 1) float4.
template <class C>
__device__ void down_grouped(const u8* __restrict__ base, long long slot_bytes,
                             const int* __restrict__ tile_slot, const int* __restrict__ tile_start,
                             const int* __restrict__ tile_count, const int* __restrict__ pairs,
                             const float* __restrict__ h, float* __restrict__ y, int I, int R,
                             long long down_packed, long long down_scale, int round_model) {
  const int tile = blockIdx.y, n = tile_count[tile];
  const int* tp = pairs + tile_start[tile];
  const u8* rec = base + (long long)tile_slot[tile] * slot_bytes;
  const int row = blockIdx.x * MTPLX_WARPS + (threadIdx.x >> 5);
  const long long packed[1] = {down_packed}, scale[1] = {down_scale};
  float acc[1][MTPLX_TILE];
  tile_dots<C, 1>(rec, packed, scale, row, R, I, h, 1, tp, n, acc);
  if (row >= R || (threadIdx.x & 31) != 0) return;
#pragma unroll
  for (int t = 0; t < MTPLX_TILE; ++t)
    if (t < n) y[(long long)tp[t] * R + row] = round_model ? round_bf16(acc[0][t]) : acc[0][t];
}

// out[t, r] = acc0[t, r] (0 when acc0 is null), then += weights[t, k] * y[t*K + k, r] for k
// ascending: multiply then add, never fused (LatentMoE's combine order, as down_combine). Empty
// picks (slots[t, k] < 0) have no y row written and are skipped. out may alias acc0 (one thread
// per element). grid ceil(T * R / 256), block 256.
extern "C" __global__ void __launch_bounds__(256) mtplx_combine(
    const float* __restrict__ y, const float* __restrict__ weights,
    const int* __restrict__ slots, const float* acc0, float* out, int T, int K, int R) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // = t * R + r
  if (i >= (long long)T * R) return;
  const int t = (int)(i / R), r = (int)(i - (long long)t * R);
  float acc = acc0 != nullptr ? acc0[i] : 0.0f;
  for (int k = 0; k < K; ++k)
    if (slots[t * K + k] >= 0)
      acc = __fadd_rn(acc, __fmul_rn(y[((long long)t * K + k) * R + r], weights[t * K + k]));
  out[i] = acc;
}

// One codec's extern "C" entry points: PREFIX_gate_up, PREFIX_down_combine (decode GEMV,
// common.cuh) and PREFIX_gate_up_grouped, PREFIX_down_grouped (above).
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
      const float* weights, const float* acc0, float* out, int K, int I, int R, long long dp, \
      long long ds, int round_model) {                                                        \
    down_combine<CODEC>(base, slot_bytes, slots, h, weights, acc0, out, K, I, R, dp, ds,      \
                        round_model);                                                         \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(32 * MTPLX_WARPS, MTPLX_GROUPED_MIN_BLOCKS) PREFIX##_gate_up_grouped(    \
      const u8* base, long long slot_bytes, const int* tile_slot, const int* tile_start,      \
      const int* tile_count, const int* pairs, const float* x, float* h, int K, int I, int R, \
      long long gp, long long gs, long long upk, long long us, float beta, float beta_lin,    \
      int round_model) {                                                                      \
    gate_up_grouped<CODEC>(base, slot_bytes, tile_slot, tile_start, tile_count, pairs, x, h,  \
                           K, I, R, gp, gs, upk, us, beta, beta_lin, round_model);            \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(32 * MTPLX_WARPS, MTPLX_GROUPED_MIN_BLOCKS) PREFIX##_down_grouped(       \
      const u8* base, long long slot_bytes, const int* tile_slot, const int* tile_start,      \
      const int* tile_count, const int* pairs, const float* h, float* y, int I, int R,        \
      long long dp, long long ds, int round_model) {                                          \
    down_grouped<CODEC>(base, slot_bytes, tile_slot, tile_start, tile_count, pairs, h, y, I,  \
                        R, dp, ds, round_model);                                              \
  }
