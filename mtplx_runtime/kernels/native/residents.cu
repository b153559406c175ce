// Quantized resident GEMV (FORMAT.md "Quantized residents"; model/quant.py): out [T, N] bf16 =
// x [T, K] bf16 times an int8, fp8 or int4 matrix [N, K] as stored, for small T (the decode
// steps), on the MMA GEMV of gemv.cuh: weights dequantized in registers, fp32 sums.
//   int8, fp8: per-row scale (bf16, fp32) applied to the fp32 sums
//   int4:      scale and zero per 32 inputs (bf16 [K / 32, N]) folded into the weights
// Entry points {int8,fp8,int4}_gemv_{x1,x4}: passes of 8 or of up to 32 tokens; grid N / 128,
// block 128. Validate: python tools/gpu_check.py (residents); tests/test_cuda_host.py.
#include "gemv.cuh"

template <class C, int KIND>
struct ResidentPass {
  Mat mats[1];
  Src src;
  const void* row_scale;
  u16* out;
  uint2* xs;
  Ctx ctx;
  int tile0;

  template <int NT>
  __device__ void run(int first, int npass) {
    float acc[2][1][NT][4];
    mainloop<C, 1, NT, 1>(mats, tile0, src, first, npass, xs, ctx, acc);
    const int N = mats[0].rows;
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * (tile0 + rt) + acc_row(e), n = acc_vec(nt, e);
          if (row >= N || n >= npass) continue;
          float v = acc[rt][0][nt][e];
          if (KIND == 0) v *= bf16_bits_to_f32(static_cast<const u16*>(row_scale)[row]);
          if (KIND == 1) v *= static_cast<const float*>(row_scale)[row];
          out[(long long)(first + n) * N + row] = (u16)bf16_rne_bits(v);
        }
  }
};

// KIND: 0 int8 (bf16 row scales), 1 fp8 (fp32 row scales), 2 int4 (folded).
template <class C, int KIND, int NTMAX>
__device__ void resident_gemv(const u8* q, const void* scale, const u8* zero, int N, int K,
                              const u16* x, int T, u16* out) {
  extern __shared__ uint2 xs[];
  ResidentPass<C, KIND> pass;
  pass.mats[0] = Mat{q, static_cast<const u8*>(scale), zero, N, K};
  pass.src = Src{x, nullptr, 1, K, false};
  pass.row_scale = scale;
  pass.out = out;
  pass.xs = xs;
  pass.tile0 = (blockIdx.x * MTPLX_BLOCK_ROWS + (threadIdx.x >> 5) * 32) / 16;
  passes<NTMAX>(T, pass);
}

#define MTPLX_RESIDENT(PREFIX, CODEC, KIND)                                                     \
  extern "C" __global__ void __launch_bounds__(MTPLX_THREADS) PREFIX##_gemv_x1(                \
      const u8* q, const void* scale, const u8* zero, int N, int K, const u16* x, int T,      \
      u16* out) {                                                                             \
    resident_gemv<CODEC, KIND, 1>(q, scale, zero, N, K, x, T, out);                           \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(MTPLX_THREADS) PREFIX##_gemv_x4(                \
      const u8* q, const void* scale, const u8* zero, int N, int K, const u16* x, int T,      \
      u16* out) {                                                                             \
    resident_gemv<CODEC, KIND, 4>(q, scale, zero, N, K, x, T, out);                           \
  }

MTPLX_RESIDENT(int8, Int8Res, 0)
MTPLX_RESIDENT(fp8, Fp8Res, 1)
MTPLX_RESIDENT(int4, Int4Res, 2)
