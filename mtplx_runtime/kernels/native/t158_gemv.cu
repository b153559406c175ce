// t158 routed-expert kernels (FORMAT.md "t158"): per row, 64-column groups of 13 bytes of
// base-3 trits (5 per byte, lowest column in the lowest trit; digit 4 of byte 12 is padding)
// and one bf16 scale (U16 bits). Ŵ = (trit - 1) * scale.
//
// Entry points (grouped.cuh MTPLX_KERNELS): t158_gate_up, t158_down_combine (decode GEMV, T
// below the host's grouped threshold) and t158_gate_up_grouped, t158_down_grouped (prefill
// chunks: tokens gathered per expert, each weight decoded once per tile of 4 pairs), plus the
// codec-free mtplx_combine.
// Validate on a GPU: python tools/gpu_check.py (compares with kernels/reference.py); compile
// check without one: python tools/check_cuda.py.
#include "grouped.cuh"

struct T158 {
  static constexpr int GROUP = 64;
  __device__ static int packed_row_bytes(int cols) { return 13 * (cols / 64); }
  __device__ static int scale_row_bytes(int cols) { return 2 * (cols / 64); }
  // Group g: byte j holds columns 5j .. 5j+4 as base-3 digits, lowest column first.
  template <class F>
  __device__ __forceinline__ static void group(const u8* packed, const u8* scale, int g, F&& f) {
    const u8* p = packed + 13 * g;
    const float s = bf16_bits_to_f32(reinterpret_cast<const u16*>(scale)[g]);
#pragma unroll
    for (int j = 0; j < 13; ++j) {
      u32 b = p[j];
#pragma unroll
      for (int d = 0; d < 5; ++d) {
        const int c = 5 * j + d;
        if (c < 64) f(c, (float)((int)(b % 3u) - 1) * s);  // (trit - 1) * scale: exact
        b /= 3u;
      }
    }
  }
};

MTPLX_KERNELS(t158, T158)
