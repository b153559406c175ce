// The MMA GEMV every kernel here runs: a block of 4 warps multiplies 128 rows of one or two
// matrices (experts: gate and up, or down; residents: one) by up to 32 activation vectors per
// pass, on tensor cores (mma m16n8k16, bf16 in, fp32 sums), the weights dequantized in registers
// by the codec (codecs.cuh). Device code only; the per-lane parts are host-tested (codecs.cuh).
//
//   per 256-column slice:  stage the pass's activations in shared memory in the codec's k order
//                          (bf16; an fp32 model's as three bf16 terms), barrier
//     per chunk:           each lane loads its bytes of its warp's two 16-row tiles
//       per unit:          B fragments from shared memory once, reused by every tile and
//                          matrix; A fragments from the codec; the MMAs (t158: into a group sum,
//                          then scaled into the accumulators)
//
// Shared memory: [t158 table 32 KiB][staged activations: PARTS x 8 NT tokens x 68 uint2].
#pragma once
#include "codecs.cuh"

#define MTPLX_THREADS 128   // 4 warps
#define MTPLX_BLOCK_ROWS 128  // 2 tiles of 16 rows per warp
// uint2 per staged token: 16 MMAs x 4 quad lanes, + 4 so that lanes (g, q) of a half-warp read
// 16 different bank pairs (token stride = 8 words mod 32).
#define MTPLX_XS_STRIDE 68
#define MTPLX_LUT_BYTES (256 * 16 * 8)

// Where a pass's activation vectors come from: vector n (< npass) is row list[first + n] / div
// of src ([*, cols], bf16 bits or fp32). Gate/up: x rows of the pairs' tokens (div = K); down:
// h rows of the pairs (div = 1); residents: x rows (list null: row first + n).
struct Src {
  const void* data;
  const int* list;
  int div, cols;
  bool f32;
};

__device__ __forceinline__ float src_at(const Src& s, long long row, int col) {
  if (s.f32) return static_cast<const float*>(s.data)[row * s.cols + col];
  return bf16_bits_to_f32(static_cast<const u16*>(s.data)[row * s.cols + col]);
}

// Slice `slice` of the pass's vectors n < npass into xs [PARTS][8 NT][MTPLX_XS_STRIDE], uint2 =
// the B registers of one lane for one MMA (k-slots 0,1 | 2,3 of slice_col); columns past cols
// are zeros. Rows n >= npass are left as they are (mainloop zeroes them once per pass). All
// threads of the block.
template <class C, int NT, int PARTS>
__device__ void stage_slice(uint2* xs, const Src& src, int first, int npass, int slice) {
  for (int idx = threadIdx.x; idx < npass * 64; idx += blockDim.x) {
    const int n = idx >> 6, mm = (idx >> 2) & 15, q = idx & 3;
    const long long row = (src.list ? src.list[first + n] : first + n) / src.div;
    u32 h[PARTS][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = slice * MTPLX_SLICE + slice_col<C>(mm, q, i);
      const float v = col < src.cols ? src_at(src, row, col) : 0.0f;
      u32 sp[PARTS];
      split_bf16<PARTS>(v, sp);
#pragma unroll
      for (int p = 0; p < PARTS; ++p) h[p][i] = sp[p];
    }
#pragma unroll
    for (int p = 0; p < PARTS; ++p)
      xs[(p * 8 * NT + n) * MTPLX_XS_STRIDE + 4 * mm + q] =
          make_uint2(h[p][0] | h[p][1] << 16, h[p][2] | h[p][3] << 16);
  }
}

// t158's table: 16 copies of the 256 entries, copy c of entry v at uint2 index 16 v + c (a lane
// reads its own copy, so a half-warp's 16 random entries never share a bank).
__device__ void build_lut(uint2* lut) {
  for (int v = threadIdx.x; v < 256; v += blockDim.x) {
    const uint2 e = T158::lut_entry(v);
#pragma unroll
    for (int c = 0; c < 16; ++c) lut[16 * v + c] = e;
  }
}

// acc[tile][matrix][n-tile][4] (the MMA C layout) = the warp's two tiles (tile0, tile0 + 1) of
// the NM matrices times the pass's vectors, over column slices s0 .. s1 - 1 (default: all).
// Tiles at or past rows / 16 are skipped. All threads of the block (barriers inside).
template <class C, int NM, int NT, int PARTS>
__device__ void mainloop(const Mat (&mats)[NM], int tile0, const Src& src, int first, int npass,
                         uint2* xs, const Ctx& ctx, float (&acc)[2][NM][NT][4], int s0 = 0,
                         int s1 = 1 << 30) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int cols = mats[0].cols, tiles = mats[0].rows / 16;
#pragma unroll
  for (int rt = 0; rt < 2; ++rt)
#pragma unroll
    for (int mx = 0; mx < NM; ++mx)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[rt][mx][nt][e] = 0.0f;
  const bool live[2] = {tile0 < tiles, tile0 + 1 < tiles};
  // Vector rows past npass stay zero for the whole pass: zeroed once here, after every warp is
  // done with the previous pass's vectors.
  __syncthreads();
  for (int i = threadIdx.x; i < PARTS * 8 * NT * MTPLX_XS_STRIDE; i += blockDim.x) {
    const int n = (i / MTPLX_XS_STRIDE) % (8 * NT);
    if (n >= npass) xs[i] = make_uint2(0u, 0u);
  }
  const int slices = min(s1, (cols + MTPLX_SLICE - 1) / MTPLX_SLICE);
  for (int s = s0; s < slices; ++s) {
    __syncthreads();  // every warp is done with the previous slice
    stage_slice<C, NT, PARTS>(xs, src, first, npass, s);
    __syncthreads();
    for (int ch = 0; ch < MTPLX_SLICE / C::KC; ++ch) {
      const int chunk = s * (MTPLX_SLICE / C::KC) + ch;
      if (chunk * C::KC >= cols) break;
      typename C::Raw raw[2][NM];
#pragma unroll
      for (int rt = 0; rt < 2; ++rt)
#pragma unroll
        for (int mx = 0; mx < NM; ++mx)
          if (live[rt]) C::load(raw[rt][mx], mats[mx], tile0 + rt, chunk, lane);
      const int units = C::units(cols, chunk);
#pragma unroll
      for (int u = 0; u < C::MMAS / C::UNIT; ++u) {
        if (u >= units) break;
        u32 b[C::UNIT][NT][PARTS][2];
#pragma unroll
        for (int j = 0; j < C::UNIT; ++j)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int p = 0; p < PARTS; ++p) {
              const uint2 v = xs[(p * 8 * NT + 8 * nt + g) * MTPLX_XS_STRIDE +
                                 4 * (ch * C::MMAS + u * C::UNIT + j) + q];
              b[j][nt][p][0] = v.x;
              b[j][nt][p][1] = v.y;
            }
#pragma unroll
        for (int rt = 0; rt < 2; ++rt) {
          if (!live[rt]) continue;
#pragma unroll
          for (int mx = 0; mx < NM; ++mx) {
            u32 a[C::UNIT][4];
            C::frags(raw[rt][mx], u, ctx, a);
            if constexpr (C::POST) {
              float sc[2];
              C::post(raw[rt][mx], u, sc);
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < C::UNIT; ++j)
#pragma unroll
                  for (int p = 0; p < PARTS; ++p)
                    mma_bf16(sum, a[j], b[j][nt][p][0], b[j][nt][p][1], sum);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                  acc[rt][mx][nt][e] = fmaf(sc[e >> 1], sum[e], acc[rt][mx][nt][e]);
              }
            } else {
#pragma unroll
              for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < C::UNIT; ++j)
#pragma unroll
                  for (int p = 0; p < PARTS; ++p)
                    mma_bf16(acc[rt][mx][nt], a[j], b[j][nt][p][0], b[j][nt][p][1],
                             acc[rt][mx][nt]);
            }
          }
        }
      }
    }
  }
}

// The first of the warp's two 16-row tiles in row block `block` (each warp 32 of its rows).
__device__ __forceinline__ int warp_tile0(int block) {
  return (block * MTPLX_BLOCK_ROWS + (threadIdx.x >> 5) * 32) / 16;
}

// f(rt, nt, e, row, n) for each accumulator of the lane (the MMA C layout): element e of n-tile
// nt of tile tile0 + rt is matrix row `row` times the pass's vector n.
template <int NT, class F>
__device__ __forceinline__ void each_acc(int tile0, F&& f) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int rt = 0; rt < 2; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        f(rt, nt, e, 16 * (tile0 + rt) + (lane >> 2) + 8 * (e >> 1),
          8 * nt + 2 * (lane & 3) + (e & 1));
}

// Whether this block is the last of `blocks` to finish, counted on `counter`: each block fences
// its stores before it counts itself, so the last one reads them all (through L2, __ldcg). The
// last block resets the counter when done, so the next launch (or graph replay) starts at 0. All
// threads of the block.
__device__ bool last_block(int* counter, int blocks) {
  __shared__ bool s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(counter, 1) == blocks - 1;
  __syncthreads();
  if (!s_last) return false;
  __threadfence();
  return true;
}

// Run `body<NT>` for passes of up to 8 NTMAX vectors, choosing NT (1, 2, 4) per pass by its size,
// so a pass of one or two vectors never pays for 32.
template <int NTMAX, class Body>
__device__ void passes(int n, Body&& body) {
  for (int first = 0; first < n; first += 8 * NTMAX) {
    const int npass = min(n - first, 8 * NTMAX);
    if (NTMAX == 1 || npass <= 8) {
      body.template run<1>(first, npass);
    } else if (NTMAX == 2 || npass <= 16) {
      body.template run<(NTMAX >= 2 ? 2 : 1)>(first, npass);
    } else {
      body.template run<NTMAX>(first, npass);
    }
  }
}
