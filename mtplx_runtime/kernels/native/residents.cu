// Quantized resident GEMV (FORMAT.md "Quantized residents"; model/quant.py): out [T, N] bf16 =
// x [T, K] bf16 times an int8, fp8 or int4 matrix [N, K] as stored, for small T (the decode
// steps), on the MMA GEMV of gemv.cuh: weights dequantized in registers, fp32 sums.
//   int8, fp8: per-row scale (bf16, fp32) applied to the fp32 sums
//   int4:      scale and zero per 32 inputs (bf16 [K / 32, N]) folded into the weights
// Entry points {int8,fp8,int4}_gemv_{x1,x4}: passes of 8 or of up to 32 tokens; grid (N / 128,
// column splits), block 128. Validate: python tools/gpu_check.py (residents);
// tests/test_cuda_host.py.
#include "gemv.cuh"

// A block computes 128 rows over `split` column slices (blockIdx.y picks which), so a matrix of
// few rows still spreads over every SM; its fp32 sums go to part [splits, T, N], and the last
// block of each row block to finish adds them in split order, scales and rounds (deterministic;
// its counter is reset for the next launch).
template <class C, int KIND>
struct ResidentPass {
  Mat mats[1];
  Src src;
  float* part;
  int T, s0, s1;
  uint2* xs;
  Ctx ctx;
  int tile0;

  template <int NT>
  __device__ void run(int first, int npass) {
    float acc[2][1][NT][4];
    mainloop<C, 1, NT, 1>(mats, tile0, src, first, npass, xs, ctx, acc, s0, s1);
    const int N = mats[0].rows;
    each_acc<NT>(tile0, [&](int rt, int nt, int e, int row, int n) {
      if (row < N && n < npass)
        part[((long long)blockIdx.y * T + first + n) * N + row] = acc[rt][0][nt][e];
    });
  }
};

// KIND: 0 int8 (bf16 row scales), 1 fp8 (fp32 row scales), 2 int4 (folded).
template <class C, int KIND, int NTMAX>
__device__ void resident_gemv(const u8* q, const void* scale, const u8* zero, int N, int K,
                              const u16* x, int T, u16* out, float* part, int* counters,
                              int split) {
  extern __shared__ uint2 xs[];
  ResidentPass<C, KIND> pass;
  pass.mats[0] = Mat{q, static_cast<const u8*>(scale), zero, N, K};
  pass.src = Src{x, nullptr, 1, K, false};
  pass.part = part;
  pass.T = T;
  pass.s0 = blockIdx.y * split;
  pass.s1 = pass.s0 + split;
  pass.xs = xs;
  pass.tile0 = warp_tile0(blockIdx.x);
  passes<NTMAX>(T, pass);
  if (!last_block(&counters[blockIdx.x], (int)gridDim.y)) return;
  const int r0 = blockIdx.x * MTPLX_BLOCK_ROWS;
  for (int i = threadIdx.x; i < T * MTPLX_BLOCK_ROWS; i += blockDim.x) {
    const int t = i / MTPLX_BLOCK_ROWS, row = r0 + i % MTPLX_BLOCK_ROWS;
    if (row >= N) continue;
    float v = 0.0f;
    for (int k = 0; k < (int)gridDim.y; ++k) v += __ldcg(part + ((long long)k * T + t) * N + row);
    if (KIND == 0) v *= bf16_bits_to_f32(static_cast<const u16*>(scale)[row]);
    if (KIND == 1) v *= static_cast<const float*>(scale)[row];
    out[(long long)t * N + row] = (u16)bf16_rne_bits(v);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

// x1: at least 4 blocks per SM (<= 128 registers): left to itself ptxas squeezes int4's into 64
// and spills.
#define MTPLX_RESIDENT(PREFIX, CODEC, KIND)                                                     \
  extern "C" __global__ void __launch_bounds__(MTPLX_THREADS, 4) PREFIX##_gemv_x1(             \
      const u8* q, const void* scale, const u8* zero, int N, int K, const u16* x, int T,      \
      u16* out, float* part, int* counters, int split) {                                      \
    resident_gemv<CODEC, KIND, 1>(q, scale, zero, N, K, x, T, out, part, counters, split);    \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(MTPLX_THREADS) PREFIX##_gemv_x4(                \
      const u8* q, const void* scale, const u8* zero, int N, int K, const u16* x, int T,      \
      u16* out, float* part, int* counters, int split) {                                      \
    resident_gemv<CODEC, KIND, 4>(q, scale, zero, N, K, x, T, out, part, counters, split);    \
  }

MTPLX_RESIDENT(int8, Int8Res, 0)
MTPLX_RESIDENT(fp8, Fp8Res, 1)
MTPLX_RESIDENT(int4, Int4Res, 2)
