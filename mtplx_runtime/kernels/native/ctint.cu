// ct-int (symmetric, dense) routed-expert kernels (FORMAT.md "ct-int"): 4-bit records as stored,
// 3-bit ones repacked in their device slots (ctint3_repack, codecs.cuh CtInt3):
// ctint{3,4}_{gate_up,down}_{bf16x1,bf16x4,f32} (scale groups of 64 columns) and
// ctint4g32_* (4-bit, groups of 32: Kimi K2 Thinking). Asymmetric records (`ct-int-asym`) have no CUDA
// kernel: the runtime refuses them on CUDA.
// Validate on a GPU: python tools/gpu_check.py; without one: tools/check_cuda.py and
// tests/test_cuda_host.py.
#include "experts.cuh"

MTPLX_EXPERT_KERNELS(ctint3, CtInt3)
MTPLX_EXPERT_KERNELS(ctint4, CtInt4<64>)
MTPLX_EXPERT_KERNELS(ctint4g32, CtInt4<32>)

// ct-int3: one 64-column group (6 words) per thread, in place.
extern "C" __global__ void __launch_bounds__(256) ctint3_repack(u32* packed, long long groups) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= groups) return;
  u32 in[6], out[6];
#pragma unroll
  for (int k = 0; k < 6; ++k) in[k] = packed[6 * i + k];
  ctint3_repack_group(in, out);
#pragma unroll
  for (int k = 0; k < 6; ++k) packed[6 * i + k] = out[k];
}
