// Routed experts of one MoE layer on the MMA GEMV (gemv.cuh), two launches per layer:
//
//   {codec}_gate_up_*  grid (items, I / 128):  h[pair, i] = SiTU-GLU(gate_i . x_t, up_i . x_t)
//   {codec}_down_*     grid (items, R / 128):  y[pair, r] = down_r . h[pair]; the last block to
//                      finish row block r0 sums out[t, r] = acc0[t, r] (or 0) + w[t, k] * y[t K + k, r]
//                      over k ascending (multiply, then add: LatentMoE's fp32 order)
//
// pair = t * K + k. An item is one expert with the tokens that chose it; a block computes its 128
// rows for all of them (weights read once per 32 tokens):
//   decode (route null, T <= 32): item = pair; the block of a token's pair that is the expert's
//     first token finds the others with a warp ballot, other blocks exit: no host round trip,
//     no extra launch.
//   routed (T > 32): items from cuda.route (pairs sorted by slot, then token): item j holds pairs
//     route_pairs[route_start[j] .. route_start[j + 1]); empty items exit.
// An expert id e < 0 (an empty pick) or one whose slot_of[e] < 0 (absent) adds nothing.
//
// Template flags: NTMAX (1: passes of 8 tokens; 4: of up to 32), PARTS (1: bf16 model, h and y
// bf16 and rounded where the reference rounds; 3: fp32 model, fp32 h and y, activations as three
// bf16 terms).
#pragma once
#include "gemv.cuh"

// The item's expert: slot (-1: nothing to do), token count n and pair list (shared memory in
// decode mode, route_pairs in routed mode). All threads of the block.
struct Work {
  int slot, n;
  const int* pairs;
};

__device__ Work find_work(const long long* ids, const int* slot_of, int T, int K,
                          const int* route_pairs, const int* route_start, int* s_pairs,
                          int* s_info) {
  const int item = blockIdx.x;
  if (route_pairs != nullptr) {
    const int start = route_start[item], n = route_start[item + 1] - start;
    const long long e = n > 0 ? ids[route_pairs[start]] : -1;
    return Work{e >= 0 ? slot_of[e] : -1, n, route_pairs + start};
  }
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, t = item / K;
    const long long e = ids[item];
    const int slot = e >= 0 ? slot_of[e] : -1;
    int k_of = -1;
    if (slot >= 0 && lane < T)
      for (int k = 0; k < K; ++k)
        if (ids[(long long)lane * K + k] == e) {
          k_of = k;
          break;
        }
    const u32 mask = __ballot_sync(0xFFFFFFFFu, k_of >= 0);
    // Only the block of the expert's first token works; the expert is in its own token's row.
    const bool mine = slot >= 0 && (mask & ((1u << t) - 1u)) == 0;
    if (mine && k_of >= 0) s_pairs[__popc(mask & ((1u << lane) - 1u))] = lane * K + k_of;
    if (lane == 0) {
      s_info[0] = mine ? slot : -1;
      s_info[1] = __popc(mask);
    }
  }
  __syncthreads();
  return Work{s_info[0], s_info[1], s_pairs};
}

struct Expert {
  const u8* base;  // slot 0
  long long slot_bytes;
};

__device__ __forceinline__ Mat expert_mat(const Expert& ex, int slot, long long packed,
                                          long long scale, int rows, int cols) {
  const u8* rec = ex.base + (long long)slot * ex.slot_bytes;
  return Mat{rec + packed, rec + scale, nullptr, rows, cols};
}

// Shared memory: dynamic [t158 table][staged activations]; static decode-mode pair list.
template <class C>
__device__ uint2* setup_smem(Ctx& ctx) {
  extern __shared__ uint2 dyn[];
  const bool lut = C::POST;  // t158, the one codec with a table
  if (lut) build_lut(dyn);
  ctx = t158_ctx(dyn, threadIdx.x & 31);
  return dyn + (lut ? MTPLX_LUT_BYTES / 8 : 0);
}

template <class C, int PARTS>
struct GateUpPass {
  Mat mats[2];
  Src src;
  const int* pairs;
  void* h;
  int I;
  float beta, beta_lin;
  uint2* xs;
  Ctx ctx;
  int tile0;

  template <int NT>
  __device__ void run(int first, int npass) {
    float acc[2][2][NT][4];
    mainloop<C, 2, NT, PARTS>(mats, tile0, src, first, npass, xs, ctx, acc);
    each_acc<NT>(tile0, [&](int rt, int nt, int e, int row, int n) {
      if (row >= I || n >= npass) return;
      const long long at = (long long)pairs[first + n] * I + row;
      float gv = acc[rt][0][nt][e], uv = acc[rt][1][nt][e];
      if (PARTS == 1) {  // a bf16 model rounds the gate and up GEMMs and the SiTU output
        gv = round_bf16(gv);
        uv = round_bf16(uv);
        static_cast<u16*>(h)[at] = (u16)bf16_rne_bits(situ_glu(gv, uv, beta, beta_lin));
      } else {
        static_cast<float*>(h)[at] = situ_glu(gv, uv, beta, beta_lin);
      }
    });
  }
};

template <class C, int NTMAX, int PARTS>
__device__ void gate_up(const u8* base, long long slot_bytes, const long long* ids,
                        const int* slot_of, int T, int K, const int* route_pairs,
                        const int* route_start, const void* x, void* h, int I, int R,
                        long long gp, long long gs, long long upk, long long us, float beta,
                        float beta_lin) {
  __shared__ int s_pairs[32], s_info[2];
  const Work w = find_work(ids, slot_of, T, K, route_pairs, route_start, s_pairs, s_info);
  if (w.slot < 0 || w.n == 0) return;  // uniform over the block
  GateUpPass<C, PARTS> pass;
  pass.xs = setup_smem<C>(pass.ctx);
  const Expert ex{base, slot_bytes};
  pass.mats[0] = expert_mat(ex, w.slot, gp, gs, I, R);
  pass.mats[1] = expert_mat(ex, w.slot, upk, us, I, R);
  pass.src = Src{x, w.pairs, K, R, PARTS == 3};
  pass.pairs = w.pairs;
  pass.h = h;
  pass.I = I;
  pass.beta = beta;
  pass.beta_lin = beta_lin;
  pass.tile0 = warp_tile0(blockIdx.y);
  passes<NTMAX>(w.n, pass);
}

template <class C, int PARTS>
struct DownPass {
  Mat mats[1];
  Src src;
  const int* pairs;
  void* y;
  int R;
  uint2* xs;
  Ctx ctx;
  int tile0;

  template <int NT>
  __device__ void run(int first, int npass) {
    float acc[2][1][NT][4];
    mainloop<C, 1, NT, PARTS>(mats, tile0, src, first, npass, xs, ctx, acc);
    each_acc<NT>(tile0, [&](int rt, int nt, int e, int row, int n) {
      if (row >= R || n >= npass) return;
      const long long at = (long long)pairs[first + n] * R + row;
      if (PARTS == 1)  // the down GEMM's output, rounded as a bf16 model does
        static_cast<u16*>(y)[at] = (u16)bf16_rne_bits(acc[rt][0][nt][e]);
      else
        static_cast<float*>(y)[at] = acc[rt][0][nt][e];
    });
  }
};

// The ordered combine of row block blockIdx.y, run by the last of its gridDim.x blocks to finish
// (last_block; the counter is reset for the next launch, so a captured CUDA graph replays
// correctly).
template <int PARTS>
__device__ void finish(const long long* ids, const int* slot_of, const float* weights,
                       const void* y, const float* acc0, float* out, int* counters, int T,
                       int K, int R) {
  if (!last_block(&counters[blockIdx.y], (int)gridDim.x)) return;
  const int r0 = blockIdx.y * MTPLX_BLOCK_ROWS;
  for (int i = threadIdx.x; i < T * MTPLX_BLOCK_ROWS; i += blockDim.x) {
    const int t = i / MTPLX_BLOCK_ROWS, r = r0 + i % MTPLX_BLOCK_ROWS;
    if (r >= R) continue;
    const long long at = (long long)t * R + r;
    float a = acc0 != nullptr ? acc0[at] : 0.0f;
    for (int k = 0; k < K; ++k) {
      const long long e = ids[(long long)t * K + k];
      if (e < 0 || slot_of[e] < 0) continue;
      const long long yi = ((long long)t * K + k) * R + r;  // written by other blocks: via L2
      const float yv = PARTS == 1 ? bf16_bits_to_f32(__ldcg(static_cast<const u16*>(y) + yi))
                                  : __ldcg(static_cast<const float*>(y) + yi);
      a = __fadd_rn(a, __fmul_rn(yv, weights[(long long)t * K + k]));
    }
    out[at] = a;
  }
  if (threadIdx.x == 0) counters[blockIdx.y] = 0;
}

template <class C, int NTMAX, int PARTS>
__device__ void down(const u8* base, long long slot_bytes, const long long* ids,
                     const int* slot_of, int T, int K, const int* route_pairs,
                     const int* route_start, const void* h, void* y, const float* weights,
                     const float* acc0, float* out, int* counters, int I, int R, long long dp,
                     long long ds) {
  __shared__ int s_pairs[32], s_info[2];
  const Work w = find_work(ids, slot_of, T, K, route_pairs, route_start, s_pairs, s_info);
  if (w.slot >= 0 && w.n > 0) {
    DownPass<C, PARTS> pass;
    pass.xs = setup_smem<C>(pass.ctx);
    pass.mats[0] = expert_mat(Expert{base, slot_bytes}, w.slot, dp, ds, R, I);
    pass.src = Src{h, w.pairs, 1, I, PARTS == 3};
    pass.pairs = w.pairs;
    pass.y = y;
    pass.R = R;
    pass.tile0 = warp_tile0(blockIdx.y);
    passes<NTMAX>(w.n, pass);
  }
  finish<PARTS>(ids, slot_of, weights, y, acc0, out, counters, T, K, R);
}

// One codec's entry points: PREFIX_{gate_up,down}_{bf16x1,bf16x4,f32}: bf16 model with passes of
// 8 (decode, T <= 8) or up to 32 tokens, fp32 model (passes of 8); MINB: blocks per SM to
// budget registers for.
#define MTPLX_EXPERT_VARIANT(PREFIX, CODEC, SUFFIX, NTMAX, PARTS, MINB)                        \
  extern "C" __global__ void __launch_bounds__(MTPLX_THREADS, MINB) PREFIX##_gate_up_##SUFFIX(\
      const u8* base, long long slot_bytes, const long long* ids, const int* slot_of, int T,  \
      int K, const int* route_pairs, const int* route_start, const void* x, void* h, int I,   \
      int R, long long gp, long long gs, long long upk, long long us, float beta,             \
      float beta_lin) {                                                                       \
    gate_up<CODEC, NTMAX, PARTS>(base, slot_bytes, ids, slot_of, T, K, route_pairs,           \
                                 route_start, x, h, I, R, gp, gs, upk, us, beta, beta_lin);   \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(MTPLX_THREADS, MINB) PREFIX##_down_##SUFFIX(   \
      const u8* base, long long slot_bytes, const long long* ids, const int* slot_of, int T,  \
      int K, const int* route_pairs, const int* route_start, const void* h, void* y,          \
      const float* weights, const float* acc0, float* out, int* counters, int I, int R,       \
      long long dp, long long ds) {                                                           \
    down<CODEC, NTMAX, PARTS>(base, slot_bytes, ids, slot_of, T, K, route_pairs, route_start, \
                              h, y, weights, acc0, out, counters, I, R, dp, ds);              \
  }

// MINB 4 (<= 128 registers) where passes are of 8 tokens: left to itself ptxas may squeeze a
// kernel under 80 registers and spill (mxfp4_down_f32 on sm_80).
#define MTPLX_EXPERT_KERNELS(PREFIX, CODEC)              \
  MTPLX_EXPERT_VARIANT(PREFIX, CODEC, bf16x1, 1, 1, 4)   \
  MTPLX_EXPERT_VARIANT(PREFIX, CODEC, bf16x4, 4, 1, 1)   \
  MTPLX_EXPERT_VARIANT(PREFIX, CODEC, f32, 1, 3, 4)
