// ct-int (symmetric, dense layout) routed-expert decode GEMV (FORMAT.md "ct-int"): per row, codes
// u = q + 2^(b-1) packed LSB-first into little-endian int32 words (3-bit: a bit stream, 64 codes
// = 6 words; 4-bit: 8 codes per word) and one bf16 scale per 64 columns.
// Ŵ = bf16_rne(float(q) * scale), rounded per element as the reference dequant does.
//
// Variants: ctint3_gate_up, ctint3_down_combine, ctint4_gate_up, ctint4_down_combine
// (common.cuh). Asymmetric (`ct-int-asym`, zero points) is not implemented here: the runtime
// refuses it on CUDA. Decode only (any T runs as T independent GEMVs). TODO: grouped GEMM for
// prefill chunks — not written yet.
// Validate on a GPU: pytest -m cuda tests/test_kernels.py; compile check: python tools/check_cuda.py.
#include "common.cuh"

template <int BITS>
struct CtInt {
  __device__ static int packed_row_bytes(int cols) { return 4 * (cols * BITS / 32); }
  __device__ static int scale_row_bytes(int cols) { return 2 * (cols / 64); }
  // Lane L handles 64-column groups L, L+32, ...: 2*BITS words per group (192 or 256 bits,
  // so every group starts on a word boundary in both layouts).
  __device__ static float dot(const u8* packed, const u8* scale, int cols, const float* xs,
                              int lane) {
    const u32* words = reinterpret_cast<const u32*>(packed);
    const u16* sc = reinterpret_cast<const u16*>(scale);
    const float off = (float)(1 << (BITS - 1));
    float acc = 0.0f;
    for (int g = lane; g < cols / 64; g += 32) {
      const u32* wg = words + 2 * BITS * g;
      const float s = bf16_bits_to_f32(sc[g]);
      const float* xg = xs + 64 * g;
      float a = 0.0f;
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        const int bit = BITS * i, wi = bit >> 5, sh = bit & 31;
        u64 pair = wg[wi];
        if (sh + BITS > 32) pair |= (u64)wg[wi + 1] << 32;  // codes 10 and 21 of a 3-bit unit
        const u32 u = (u32)(pair >> sh) & ((1u << BITS) - 1u);
        a += round_bf16(((float)u - off) * s) * xg[i];
      }
      acc += a;
    }
    return acc;
  }
};

MTPLX_KERNELS(ctint3, CtInt<3>)
MTPLX_KERNELS(ctint4, CtInt<4>)
