// mxfp4 routed-expert kernels (FORMAT.md "mxfp4"): per row, bytes of two E2M1 nibbles
// (column 2k low, 2k+1 high; bit 3 sign, magnitude table 0 .5 1 1.5 2 3 4 6) and one E8M0
// scale byte per 32 columns, scale = 2^(e - 127). Ŵ = E2M1 * scale.
//
// Entry points (grouped.cuh MTPLX_KERNELS): mxfp4_gate_up, mxfp4_down_combine (decode GEMV) and
// mxfp4_gate_up_grouped, mxfp4_down_grouped (prefill chunks), plus mtplx_combine.
// Validate on a GPU: python tools/gpu_check.py; compile check: python tools/check_cuda.py.
#include "grouped.cuh"

__device__ __forceinline__ float e2m1(u32 nib) {
  // magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 as (2 + m) * 2^(e - 2) style arithmetic, no table
  const u32 m = nib & 7u;
  float v = (m < 2u) ? 0.5f * (float)m : (float)(2u + (m & 1u)) * (float)(1u << ((m >> 1) - 1u)) * 0.5f;
  return (nib & 8u) ? -v : v;
}

struct MXFP4 {
  static constexpr int GROUP = 32;
  __device__ static int packed_row_bytes(int cols) { return cols / 2; }
  __device__ static int scale_row_bytes(int cols) { return cols / 32; }
  // Group g is 16 bytes: one aligned 16-byte load (rows and components start 16-aligned because
  // cols % 32 == 0 and records are 4 KiB-aligned). Column j is nibble j & 7 of word j >> 3.
  template <class F>
  __device__ __forceinline__ static void group(const u8* packed, const u8* scale, int g, F&& f) {
    const uint4 q = *reinterpret_cast<const uint4*>(packed + 16 * g);
    const u32 w[4] = {q.x, q.y, q.z, q.w};
    const float s = ldexpf(1.0f, (int)scale[g] - 127);
#pragma unroll
    for (int j = 0; j < 32; ++j) f(j, e2m1((w[j >> 3] >> (4 * (j & 7))) & 0xFu) * s);
  }
};

MTPLX_KERNELS(mxfp4, MXFP4)
