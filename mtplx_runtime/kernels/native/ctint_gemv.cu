// ct-int (symmetric, dense layout) routed-expert kernels (FORMAT.md "ct-int"): per row, codes
// u = q + 2^(b-1) packed LSB-first into little-endian int32 words (3-bit: a bit stream, 64 codes
// = 6 words; 4-bit: 8 codes per word) and one bf16 scale per 64 columns.
// Ŵ = bf16_rne(float(q) * scale), rounded per element as the reference dequant does.
//
// Entry points (grouped.cuh MTPLX_KERNELS): ctint{3,4}_gate_up, ctint{3,4}_down_combine (decode
// GEMV) and ctint{3,4}_gate_up_grouped, ctint{3,4}_down_grouped (prefill chunks), plus
// mtplx_combine. Asymmetric (`ct-int-asym`, zero points) is not implemented here: the runtime
// refuses it on CUDA.
// Validate on a GPU: python tools/gpu_check.py; compile check: python tools/check_cuda.py.
#include "grouped.cuh"

template <int BITS>
struct CtInt {
  static constexpr int GROUP = 64;
  __device__ static int packed_row_bytes(int cols) { return 4 * (cols * BITS / 32); }
  __device__ static int scale_row_bytes(int cols) { return 2 * (cols / 64); }
  // Group g is 2*BITS words (192 or 256 bits, so every group starts on a word boundary in both
  // layouts); code i is stream bits BITS*i .. BITS*i + BITS - 1 of the group.
  template <class F>
  __device__ __forceinline__ static void group(const u8* packed, const u8* scale, int g, F&& f) {
    const u32* wg = reinterpret_cast<const u32*>(packed) + 2 * BITS * g;
    const float s = bf16_bits_to_f32(reinterpret_cast<const u16*>(scale)[g]);
    const float off = (float)(1 << (BITS - 1));
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int bit = BITS * i, wi = bit >> 5, sh = bit & 31;
      u64 pair = wg[wi];
      if (sh + BITS > 32) pair |= (u64)wg[wi + 1] << 32;  // codes 10 and 21 of a 3-bit unit
      const u32 u = (u32)(pair >> sh) & ((1u << BITS) - 1u);
      f(i, round_bf16(((float)u - off) * s));
    }
  }
};

MTPLX_KERNELS(ctint3, CtInt<3>)
MTPLX_KERNELS(ctint4, CtInt<4>)
