// t158 routed-expert kernels (FORMAT.md "t158"), on records repacked in their device slots
// (t158_repack, codecs.cuh T158): t158_{gate_up,down}_{bf16x1,bf16x4,f32} and t158_repack.
// Validate on a GPU: python tools/gpu_check.py; without one: python tools/check_cuda.py (nvcc)
// and tests/test_cuda_host.py (the per-lane code on the CPU).
#include "experts.cuh"

MTPLX_EXPERT_KERNELS(t158, T158)

// t158: one band of 16 rows of one projection per block: staged in shared memory (16 * 15 * G
// bytes), then written back in the device order (codecs.cuh T158). In place.
extern "C" __global__ void __launch_bounds__(256) t158_repack(u8* packed, u8* scale, int cols) {
  extern __shared__ u8 band[];
  const int G = cols / 64, np = 16 * 13 * G, ns = 16 * 2 * G;
  u8* p = packed + (long long)blockIdx.x * np;
  u8* s = scale + (long long)blockIdx.x * ns;
  for (int e = threadIdx.x; e < np; e += blockDim.x) band[e] = p[e];
  for (int e = threadIdx.x; e < ns; e += blockDim.x) band[np + e] = s[e];
  __syncthreads();
  for (int e = threadIdx.x; e < np; e += blockDim.x) p[t158_packed_dst(G, e)] = band[e];
  for (int e = threadIdx.x; e < ns; e += blockDim.x) s[t158_scale_dst(G, e)] = band[np + e];
}
