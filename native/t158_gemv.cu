// t158 routed-expert decode GEMV (FORMAT.md "t158"): per row, 64-column groups of 13 bytes of
// base-3 trits (5 per byte, lowest column in the lowest trit; digit 4 of byte 12 is padding)
// and one bf16 scale (U16 bits). Ŵ = (trit - 1) * scale.
//
// Variants: t158_gate_up, t158_down_combine (common.cuh). Decode only (any T runs as T
// independent GEMVs, grid.z / grid.y = T). TODO: grouped GEMM for prefill chunks (tokens
// gathered per expert, weights decoded once per tile) — not written yet.
// Validate on a GPU: pytest -m cuda tests/test_kernels.py (compares with kernels/reference.py);
// compile check without one: python tools/check_cuda.py.
#include "common.cuh"

struct T158 {
  __device__ static int packed_row_bytes(int cols) { return 13 * (cols / 64); }
  __device__ static int scale_row_bytes(int cols) { return 2 * (cols / 64); }
  // Lane L handles groups L, L+32, ...: the sum of trit*x over the group, times the scale.
  __device__ static float dot(const u8* packed, const u8* scale, int cols, const float* xs,
                              int lane) {
    const u16* sc = reinterpret_cast<const u16*>(scale);
    float acc = 0.0f;
    for (int g = lane; g < cols / 64; g += 32) {
      const u8* p = packed + 13 * g;
      const float* xg = xs + 64 * g;
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < 13; ++j) {
        u32 b = p[j];
#pragma unroll
        for (int d = 0; d < 5; ++d) {
          const int c = 5 * j + d;
          if (c < 64) s += (float)((int)(b % 3u) - 1) * xg[c];
          b /= 3u;
        }
      }
      acc += s * bf16_bits_to_f32(sc[g]);
    }
    return acc;
  }
};

MTPLX_KERNELS(t158, T158)
