// Host build of the CUDA kernels' per-lane code (kernels/native/codecs.cuh), driven the way the
// kernels drive it: for every 16-row tile, activation slice, chunk and unit, each of the 32 lanes
// loads its bytes and builds its A fragments, the B fragments come from activations staged in
// the codecs' k order, and the warp MMA is emulated from the PTX fragment layout. So a wrong
// offset, k order, nibble, table entry or scale shows up as a wrong product on the CPU.
// tests/test_cuda_host.py builds it (c++ -shared) and compares with the NumPy codecs.
#include <cmath>
#include <cstring>
#include <vector>

#include "codecs.cuh"

namespace {

double lo(u32 v) { return bf16_bits_to_f32(v & 0xFFFFu); }
double hi(u32 v) { return bf16_bits_to_f32(v >> 16); }

// d = a . b + c for the 32 lanes of a warp (the fragment layout of common.cuh mma_bf16), summed
// in double and rounded to fp32: the tensor core's fp32 sum order is not specified.
void mma_emulate(float (&d)[32][4], const u32 (&a)[32][4], const u32 (&b)[32][2],
                 const float (&c)[32][4]) {
  double A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    A[g][2 * q] = lo(a[lane][0]), A[g][2 * q + 1] = hi(a[lane][0]);
    A[g + 8][2 * q] = lo(a[lane][1]), A[g + 8][2 * q + 1] = hi(a[lane][1]);
    A[g][2 * q + 8] = lo(a[lane][2]), A[g][2 * q + 9] = hi(a[lane][2]);
    A[g + 8][2 * q + 8] = lo(a[lane][3]), A[g + 8][2 * q + 9] = hi(a[lane][3]);
    B[2 * q][g] = lo(b[lane][0]), B[2 * q + 1][g] = hi(b[lane][0]);
    B[2 * q + 8][g] = lo(b[lane][1]), B[2 * q + 9][g] = hi(b[lane][1]);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, q = lane & 3;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), n = 2 * q + (e & 1);
      double s = c[lane][e];
      for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][n];
      d[lane][e] = (float)s;
    }
  }
}

// y [T, rows] = W x for one matrix in the device layout; x fp32 [T, cols], staged as `parts`
// bf16 terms (1: x must be bf16 values; 3: any fp32).
template <class C>
void emulate(const Mat& m, const float* x, int T, int parts, float* y) {
  std::vector<uint2> lut(256 * 16);
  for (int v = 0; v < 256; ++v)
    for (int c = 0; c < 16; ++c) lut[v * 16 + c] = T158::lut_entry(v);
  const int NT = (T + 7) / 8, ntok = 8 * NT;
  const int slices = (m.cols + MTPLX_SLICE - 1) / MTPLX_SLICE;
  // staged B: [part][token][16 MMAs][4 quad lanes] uint2, as gemv.cuh stage_slice
  std::vector<uint2> xs((size_t)parts * ntok * MTPLX_SLICE_MMAS * 4);
  static float acc[32][4][4], tmp[32][4];
  static u32 A[32][C::UNIT][4], Bf[32][2];
  static typename C::Raw raw[32];
  for (int tile = 0; tile < m.rows / 16; ++tile) {
    std::memset(acc, 0, sizeof acc);
    for (int s = 0; s < slices; ++s) {
      for (int p = 0; p < parts; ++p)
        for (int n = 0; n < ntok; ++n)
          for (int mm = 0; mm < MTPLX_SLICE_MMAS; ++mm)
            for (int q = 0; q < 4; ++q) {
              u32 h[4];
              for (int i = 0; i < 4; ++i) {
                const int col = s * MTPLX_SLICE + slice_col<C>(mm, q, i);
                const float v = n < T && col < m.cols ? x[(size_t)n * m.cols + col] : 0.0f;
                u32 sp[3];
                split_bf16<3>(v, sp);
                h[i] = sp[p];
              }
              uint2& e = xs[(((size_t)p * ntok + n) * MTPLX_SLICE_MMAS + mm) * 4 + q];
              e.x = h[0] | h[1] << 16;
              e.y = h[2] | h[3] << 16;
            }
      for (int ch = 0; ch < MTPLX_SLICE / C::KC; ++ch) {
        const int chunk = s * (MTPLX_SLICE / C::KC) + ch;
        if (chunk * C::KC >= m.cols) break;
        for (int lane = 0; lane < 32; ++lane) C::load(raw[lane], m, tile, chunk, lane);
        const int units = C::units(m.cols, chunk);
        for (int u = 0; u < units; ++u) {
          for (int lane = 0; lane < 32; ++lane) {
            const Ctx ctx = t158_ctx(lut.data(), lane);
            C::frags(raw[lane], u, ctx, A[lane]);
          }
          for (int nt = 0; nt < NT; ++nt) {
            // POST codecs sum a unit into fresh accumulators, then scale them into acc
            float cur[32][4];
            for (int lane = 0; lane < 32; ++lane)
              for (int e = 0; e < 4; ++e) cur[lane][e] = C::POST ? 0.0f : acc[lane][nt][e];
            for (int j = 0; j < C::UNIT; ++j) {
              const int mm = ch * C::MMAS + u * C::UNIT + j;
              u32 a[32][4];
              for (int lane = 0; lane < 32; ++lane) std::memcpy(a[lane], A[lane][j], 16);
              for (int p = 0; p < parts; ++p) {
                for (int lane = 0; lane < 32; ++lane) {
                  const int g = lane >> 2, q = lane & 3;
                  const uint2 e =
                      xs[(((size_t)p * ntok + 8 * nt + g) * MTPLX_SLICE_MMAS + mm) * 4 + q];
                  Bf[lane][0] = e.x, Bf[lane][1] = e.y;
                }
                mma_emulate(tmp, a, Bf, cur);
                std::memcpy(cur, tmp, sizeof tmp);
              }
            }
            for (int lane = 0; lane < 32; ++lane) {
              if constexpr (C::POST) {
                float sc[2];
                C::post(raw[lane], u, sc);
                for (int e = 0; e < 4; ++e)
                  acc[lane][nt][e] = std::fma(sc[e >> 1], cur[lane][e], acc[lane][nt][e]);
              } else {
                for (int e = 0; e < 4; ++e) acc[lane][nt][e] = cur[lane][e];
              }
            }
          }
        }
      }
    }
    for (int lane = 0; lane < 32; ++lane)
      for (int nt = 0; nt < NT; ++nt)
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * tile + (lane >> 2) + 8 * (e >> 1);
          const int n = 8 * nt + 2 * (lane & 3) + (e & 1);
          if (n < T) y[(size_t)n * m.rows + row] = acc[lane][nt][e];
        }
  }
}

}  // namespace

extern "C" {

// codec: 0 t158, 1 mxfp4, 2 ct-int3, 3 ct-int4, 7 ct-int4 with groups of 32, 8 fp8-block
// (experts, device layout: t158 and ct-int3 after the repacks below), 4 int8, 5 fp8, 6 int4
// (residents, as stored). T <= 32. Returns 0, or -1
// for an unknown codec or T.
int mtplx_emulate(int codec, const u8* packed, const u8* scale, const u8* zero, int rows,
                  int cols, const float* x, int T, int parts, float* y) {
  const Mat m{packed, scale, zero, rows, cols};
  if (T < 1 || T > 32 || (parts != 1 && parts != 3)) return -1;
  switch (codec) {
    case 0: emulate<T158>(m, x, T, parts, y); return 0;
    case 1: emulate<MXFP4>(m, x, T, parts, y); return 0;
    case 2: emulate<CtInt3>(m, x, T, parts, y); return 0;
    case 3: emulate<CtInt4<64>>(m, x, T, parts, y); return 0;
    case 4: emulate<Int8Res>(m, x, T, parts, y); return 0;
    case 5: emulate<Fp8Res>(m, x, T, parts, y); return 0;
    case 6: emulate<Int4Res>(m, x, T, parts, y); return 0;
    case 7: emulate<CtInt4<32>>(m, x, T, parts, y); return 0;
    case 8: emulate<Fp8Block>(m, x, T, parts, y); return 0;
    default: return -1;
  }
}

// A t158 matrix [rows, cols] (stored packed and scales) -> the device layout, band by band.
void mtplx_t158_repack(const u8* packed, const u8* scale, u8* out_packed, u8* out_scale,
                       int rows, int cols) {
  const int G = cols / 64;
  for (int b = 0; b < rows / 16; ++b) {
    const long long pb = (long long)b * 16 * 13 * G, sb = (long long)b * 16 * 2 * G;
    for (int e = 0; e < 16 * 13 * G; ++e) out_packed[pb + t158_packed_dst(G, e)] = packed[pb + e];
    for (int e = 0; e < 16 * 2 * G; ++e) out_scale[sb + t158_scale_dst(G, e)] = scale[sb + e];
  }
}

// A dense ct-int3 matrix [rows, cols] -> the device layout, in place.
void mtplx_ctint3_repack(u8* packed, int rows, int cols) {
  u32* w = reinterpret_cast<u32*>(packed);
  for (long long g = 0; g < (long long)rows * (cols / 64); ++g) {
    u32 in[6], out[6];
    std::memcpy(in, w + 6 * g, 24);
    ctint3_repack_group(in, out);
    std::memcpy(w + 6 * g, out, 24);
  }
}

// t158's table (256 entries of 2 words) and the PTX emulations, for bit-level tests.
void mtplx_t158_lut(u32* out) {
  for (int v = 0; v < 256; ++v) {
    const uint2 e = T158::lut_entry(v);
    out[2 * v] = e.x, out[2 * v + 1] = e.y;
  }
}
u32 mtplx_prmt(u32 a, u32 b, u32 s) { return prmt(a, b, s); }
u32 mtplx_bf16x2_fma(u32 a, u32 b, u32 c) { return bf16x2_fma(a, b, c); }
}
