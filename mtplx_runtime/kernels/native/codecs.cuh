// Codecs of the MMA GEMV (gemv.cuh): how one lane loads its bytes of a 16-row tile and turns
// them into bf16 MMA fragments. Everything here is MTPLX_HD: tests/cuda_host builds it with a
// plain C++ compiler and checks the whole path (repack, loads, dequant, k order) against the
// codecs' NumPy decode.
//
// Work split (every codec): a warp multiplies a 16-row tile of a matrix by up to 32 token
// vectors with mma m16n8k16. Lane (g, q) = (lane / 4, lane % 4) holds rows g and g + 8 of the
// tile (index rho = 0, 1). Columns come in chunks of KC; the 4 lanes of a quad split a chunk, each
// loading its own bytes of both rows with 8- or 16-byte loads. A chunk feeds MMAS = KC / 16
// MMAs; `col(m, q, i)` is the chunk column of k-slot i (0..3: a/b register 0 low and high half,
// register 1 low and high) of lane quad-position q in MMA m: the k order is the codec's choice,
// and the activations are staged in the same order (gemv.cuh), so any order gives the same sum.
//
// Scales: `fold` codecs multiply each weight by its scale in bf16 before the MMA (one rounding,
// the reference's dequantized value or, for ct-int, exactly it); t158 feeds +-2 and 0 and applies
// 0.5 * scale to each group's fp32 MMA sum (POST): a quad then shares one group per MMA.
//
// Codec contract (static members):
//   KC, MMAS, UNIT         columns per chunk, MMAs per chunk, MMAs per `frags` call
//   POST                   group scale applied after the MMAs of each unit (t158)
//   Raw, load(raw, m, tile, chunk, lane)       one lane's bytes of one chunk of a 16-row tile
//   frags(raw, u, ctx, a)  a[j][0..3]: the A registers of MMAs u * UNIT + j, j < UNIT
//   units(cols, chunk)     units of chunk that hold columns (a partial last t158 chunk has fewer)
//   post(raw, u, s)        (POST only) fp32 factor of unit u's sums for rows g, g + 8
//   col(m, q, i)           the chunk column of k-slot i of quad lane q in MMA m
#pragma once
#include "common.cuh"

#define MTPLX_SLICE 256      // columns of activations staged at a time: 16 MMAs of k16
#define MTPLX_SLICE_MMAS 16

// One matrix of a record (or a resident): component pointers and its shape [rows, cols].
struct Mat {
  const u8* packed;
  const u8* scale;
  const u8* zero;  // int4 residents only
  int rows, cols;
};

// What a lane needs beyond its bytes: t158's shared-memory table and its copy offsets.
struct Ctx {
  const uint2* lut;  // t158: [256 byte values][16 copies] entries (t158_lut_entry)
  u32 own8;          // byte offset of this lane's copy: (lane % 16) * 8
  u32 quad8;         // byte offset of this quad's copy: (lane / 4) * 8
  u32 sel15;         // PRMT selector of t158 weight pair (14, 15), which depends on q
};

MTPLX_HD u32 byte_of(const u32* w, int i) { return (w[i >> 2] >> (8 * (i & 3))) & 0xFFu; }

// Column (inside a 256-column slice) of k-slot i of quad lane q in the slice's MMA m (0..15):
// the order in which activations are staged for the B operand.
template <class C>
MTPLX_HD int slice_col(int m, int q, int i) {
  return (m / C::MMAS) * C::KC + C::col(m % C::MMAS, q, i);
}

// ---- t158 (FORMAT.md "t158"), repacked in device slots --------------------------------------
//
// A 64-column group is 13 bytes of 5 base-3 digits (lowest column lowest) per row plus a bf16
// scale. A quad shares each group: lane q takes bytes 3q, 3q+1, 3q+2 (columns 15q .. 15q+14)
// and digit q of byte 12 (column 60 + q); digit 4 of byte 12 is the padding slot. Each byte
// becomes up to five weights through a 256-entry table of bf16 high bytes (-2 -> 0xC0, 0 -> 0,
// +2 -> 0x40; a low byte of 0 completes them), assembled in pairs by PRMT: no arithmetic per
// weight. The group's MMA sum is scaled by 0.5 * scale in fp32.
//
// Device layout (t158_repack_band): each band of 16 rows keeps its bytes (16 * 13 * G packed,
// 16 * 2 * G scales, G = cols / 64 groups) but reorders them by chunk of 4 groups (n = 4, or
// fewer in a last partial chunk), so a lane's bytes are contiguous:
//   packed chunk c at band + 832 c:  [32 lanes][6 n bytes: group i, row rho, byte 3q + beta at
//                                     6 i + 3 rho + beta] then [8 quads][2 n bytes: byte 12 of
//                                     group i, row rho at 2 i + rho]
//   scales chunk c at band + 128 c:  [8 quads][n groups][2 rows] bf16
// Same size as the stored record: slots hold the repacked record, nothing more.
struct T158 {
  static constexpr int KC = 256, MMAS = 16, UNIT = 4;
  static constexpr bool POST = true;
  struct Raw {
    u32 main[6];  // 24 bytes: 4 groups x 2 rows x 3 bytes
    u32 b12[2];   // the quad's 8 bytes 12
    u32 sc[4];    // the quad's 4 groups x 2 rows of scales
  };

  // Offsets inside one band of 16 rows of G groups: packed byte of (row r in 0..15, group gi,
  // byte j in 0..12), scale of (r, gi). Inverse of the stored order; shared by the repack.
  static MTPLX_HD int packed_at(int G, int r, int gi, int j) {
    const int c = gi / 4, n = min4(G - 4 * c), i = gi - 4 * c, g = r & 7, rho = r >> 3;
    const int base = 832 * c;
    if (j < 12) return base + (4 * g + j / 3) * 6 * n + 6 * i + 3 * rho + j % 3;
    return base + 192 * n + g * 2 * n + 2 * i + rho;
  }
  static MTPLX_HD int scale_at(int G, int r, int gi) {
    const int c = gi / 4, n = min4(G - 4 * c), i = gi - 4 * c;
    return 128 * c + ((r & 7) * n + i) * 4 + 2 * (r >> 3);
  }
  static MTPLX_HD int min4(int n) { return n < 4 ? n : 4; }

  static MTPLX_HD void load(Raw& w, const Mat& m, int tile, int chunk, int lane) {
    const int G = m.cols / 64, g = lane >> 2;
    const int n = min4(G - 4 * chunk);
    const u8* p = m.packed + (long long)tile * 16 * 13 * G + 832 * chunk;
    const u8* s = m.scale + (long long)tile * 16 * 2 * G + 128 * chunk;
    if (n == 4) {  // 8- and 16-byte aligned (records are 4 KiB-aligned, bands 208 G bytes)
      const uint2* pm = reinterpret_cast<const uint2*>(p + 24 * lane);
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const uint2 v = pm[k];
        w.main[2 * k] = v.x;
        w.main[2 * k + 1] = v.y;
      }
      const uint2 b = *reinterpret_cast<const uint2*>(p + 768 + 8 * g);
      w.b12[0] = b.x;
      w.b12[1] = b.y;
      const uint4 v = *reinterpret_cast<const uint4*>(s + 16 * g);
      w.sc[0] = v.x, w.sc[1] = v.y, w.sc[2] = v.z, w.sc[3] = v.w;
      return;
    }
    // A partial last chunk (G % 4 != 0, never at K3 shapes): byte by byte, into registers
    // (every index a compile-time constant).
#pragma unroll
    for (int k = 0; k < 24; ++k) {
      const u32 v = k < 6 * n ? p[6 * n * lane + k] : 0u;
      w.main[k >> 2] = (k & 3 ? w.main[k >> 2] : 0u) | v << 8 * (k & 3);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const u32 v = k < 2 * n ? p[192 * n + 2 * n * g + k] : 0u;
      w.b12[k >> 2] = (k & 3 ? w.b12[k >> 2] : 0u) | v << 8 * (k & 3);
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const u32 v = k < 4 * n ? s[4 * n * g + k] : 0u;
      w.sc[k >> 2] = (k & 3 ? w.sc[k >> 2] : 0u) | v << 8 * (k & 3);
    }
  }

  static MTPLX_HD int units(int cols, int chunk) { return min4(cols / 64 - 4 * chunk); }

  // Table entry of byte value v: .x = high bytes of digits 0..3, .y = digit 4's, then zeros.
  static MTPLX_HD uint2 lut_entry(u32 v) {
    u32 hb[5];
#pragma unroll
    for (int k = 0; k < 5; ++k) {
      const u32 d = v % 3u;  // floor(v / 3^k) mod 3: FORMAT.md's rule, bytes 243..255 too
      hb[k] = d == 0 ? 0xC0u : d == 2 ? 0x40u : 0u;
      v /= 3u;
    }
    uint2 e;
    e.x = hb[0] | hb[1] << 8 | hb[2] << 16 | hb[3] << 24;
    e.y = hb[4];
    return e;
  }

  static MTPLX_HD uint2 lookup(const Ctx& c, u32 byte, u32 copy8) {
    return *reinterpret_cast<const uint2*>(reinterpret_cast<const u8*>(c.lut) +
                                           ((byte << 7) | copy8));
  }

  // A registers of the 4 MMAs of group u. Lane weights w0..w15 of a row: byte 3q digits 0..4,
  // byte 3q+1, byte 3q+2, then digit q of byte 12; MMA j takes pairs (w4j, w4j+1) and
  // (w4j+2, w4j+3). A pair register is [0, hb, 0, hb'] (bf16 +-2 or 0 in each half).
  static MTPLX_HD void frags(const Raw& w, int u, const Ctx& c, u32 (&a)[UNIT][4]) {
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      const int o = 6 * u + 3 * rho;
      const uint2 e0 = lookup(c, byte_of(w.main, o), c.own8);
      const uint2 e1 = lookup(c, byte_of(w.main, o + 1), c.own8);
      const uint2 e2 = lookup(c, byte_of(w.main, o + 2), c.own8);
      const uint2 e3 = lookup(c, byte_of(w.b12, 2 * u + rho), c.quad8);
      // selector nibbles: output bytes 0..3 <- source bytes; 5 (or 1) is a zero byte of .y
      a[0][rho] = prmt(e0.x, e0.y, 0x1505u);      // w0 w1
      a[0][2 + rho] = prmt(e0.x, e0.y, 0x3525u);  // w2 w3
      a[1][rho] = prmt(e0.y, e1.x, 0x4101u);      // w4 w5
      a[1][2 + rho] = prmt(e1.x, e1.y, 0x2515u);  // w6 w7
      a[2][rho] = prmt(e1.x, e1.y, 0x4535u);      // w8 w9
      a[2][2 + rho] = prmt(e2.x, e2.y, 0x1505u);  // w10 w11
      a[3][rho] = prmt(e2.x, e2.y, 0x3525u);      // w12 w13
      a[3][2 + rho] = prmt(e2.y, e3.x, c.sel15);  // w14 w15
    }
  }

  // 0.5 * scale (rows g, g + 8) of group u: the table's weights are +-2.
  static MTPLX_HD void post(const Raw& w, int u, float (&s)[2]) {
    s[0] = 0.5f * bf16_bits_to_f32(w.sc[u] & 0xFFFFu);
    s[1] = 0.5f * bf16_bits_to_f32(w.sc[u] >> 16);
  }

  static MTPLX_HD int col(int m, int q, int i) {
    const int k = 4 * (m & 3) + i;  // lane weight index w_k of group m / 4
    return 64 * (m >> 2) + (k < 15 ? 15 * q + k : 60 + q);
  }
};

// The repack of one band of 16 rows, one byte at a time: byte e of the stored band (row-major
// 16 x 13 G packed, or 16 x 2 G scale bytes) goes to its device position. The repack kernel
// (experts.cuh) stages a band in shared memory and writes it back through these.
MTPLX_HD int t158_packed_dst(int G, int e) {
  const int r = e / (13 * G), rem = e - r * 13 * G;
  return T158::packed_at(G, r, rem / 13, rem % 13);
}
MTPLX_HD int t158_scale_dst(int G, int e) {
  const int r = e / (2 * G), rem = e - r * 2 * G;
  return T158::scale_at(G, r, rem / 2) + (rem & 1);
}

MTPLX_HD Ctx t158_ctx(const uint2* lut, int lane) {
  Ctx c;
  c.lut = lut;
  c.own8 = (u32)(lane & 15) * 8u;
  c.quad8 = (u32)(lane >> 2) * 8u;
  // w14 = digit 4 of byte 3q+2 (.y byte 0), w15 = digit q of byte 12 (source byte 4 + q)
  c.sel15 = 0x0101u | (u32)(4 + (lane & 3)) << 12;
  return c;
}

// ---- 4-bit codes: mxfp4 and ct-int4 experts, int4 residents ---------------------------------
//
// A lane loads 16 bytes (32 columns) of each of its two rows: lane q of a quad covers columns
// 32q .. 32q+31 of a 128-column chunk. Word w holds columns 8w .. 8w+7, column 8w + k in nibble k
// (FORMAT.md: mxfp4 column 2k in the low nibble of byte k; ct-int code i at bit 4i of its word).
// A bf16 pair takes nibble jj of both 16-bit halves: columns 8w + jj and 8w + 4 + jj, so one
// shift and mask serve two weights. MMA m uses word m / 2, nibbles 2 (m % 2) and 2 (m % 2) + 1.
template <class D>  // the codec: D::pair(raw, rho, word, jj) is its bf16 pair
struct Nibbles {
  static constexpr int KC = 128, MMAS = 8, UNIT = 1;
  static constexpr bool POST = false;
  static MTPLX_HD int units(int, int) { return MMAS; }  // lanes past the columns hold zeros
  static MTPLX_HD int col(int m, int q, int i) {
    return 32 * q + 8 * (m >> 1) + 4 * (i & 1) + 2 * (m & 1) + (i >> 1);
  }
  // Lane's first column in the chunk, its two row pointers' offsets (bytes) and whether it holds
  // columns at all (a partial last chunk).
  static MTPLX_HD int col0(int chunk, int lane) { return chunk * KC + 32 * (lane & 3); }
  static MTPLX_HD void load16(u32 (&q)[2][4], const Mat& m, int tile, int c0, int lane) {
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      const long long r = 16LL * tile + (lane >> 2) + 8 * rho;
      const uint4 v = *reinterpret_cast<const uint4*>(m.packed + r * (m.cols / 2) + c0 / 2);
      q[rho][0] = v.x, q[rho][1] = v.y, q[rho][2] = v.z, q[rho][3] = v.w;
    }
  }
  // The lane's codes of both rows, when it holds columns of this chunk (raw.has).
  template <class Raw>
  static MTPLX_HD bool load_codes(Raw& w, const Mat& m, int tile, int c0, int lane) {
    w.has = c0 < m.cols;
    if (w.has) load16(w.q, m, tile, c0, lane);
    return w.has;
  }
  // Nibble jj of both halves of word x, as integers in the 16-bit lanes.
  static MTPLX_HD u32 nib(u32 x, int jj) { return (x >> (4 * jj)) & 0x000F000Fu; }
  template <class Raw>
  static MTPLX_HD void frags(const Raw& w, int m, const Ctx&, u32 (&a)[1][4]) {
    const int word = m >> 1, jj = 2 * (m & 1);
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      a[0][rho] = w.has ? D::pair(w, rho, word, jj) : 0u;
      a[0][2 + rho] = w.has ? D::pair(w, rho, word, jj + 1) : 0u;
    }
  }
};

#define MTPLX_BF16X2_NEG136 0xC308C308u  // (-136, -136): 0x4300 | u is bf16 128 + u
#define MTPLX_BF16X2_NEG132 0xC304C304u  // (-132, -132)
#define MTPLX_BF16X2_2P126 0x7E807E80u   // (2^126, 2^126)
#define MTPLX_BF16X2_2P120 0x7B807B80u   // (2^120, 2^120)

// mxfp4 (FORMAT.md "mxfp4"): E2M1 nibbles, one E8M0 scale per 32 columns (a lane's 32).
struct MXFP4 : Nibbles<MXFP4> {
  struct Raw {
    u32 q[2][4];
    u32 s2[2];  // bf16 2^(e - 127) in both halves, rows g and g + 8
    bool has;
  };
  static MTPLX_HD void load(Raw& w, const Mat& m, int tile, int chunk, int lane) {
    const int c0 = col0(chunk, lane);
    if (!load_codes(w, m, tile, c0, lane)) return;
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      const long long r = 16LL * tile + (lane >> 2) + 8 * rho;
      const u32 e = m.scale[r * (m.cols / 32) + c0 / 32];
      w.s2[rho] = bf16x2_splat(e ? e << 7 : 0x40u);  // 2^(e-127); e = 0: the bf16 subnormal
    }
  }
  // Nibble jj of both halves -> bf16 e2m1 * 2^-126 (sign to bit 15, exponent and mantissa bits
  // to 6..8: subnormal for 0 and 0.5), times 2^126 exactly, times the scale: the reference's
  // exact weight (or +-Inf where e2m1 * 2^(e-127) overflows, as the reference).
  static MTPLX_HD u32 pair(const Raw& w, int rho, int word, int jj) {
    const u32 x = w.q[rho][word] << (12 - 4 * jj);
    const u32 v = (x & 0x80008000u) | ((x >> 6) & 0x01C001C0u);
    return bf16x2_mul(bf16x2_mul(v, MTPLX_BF16X2_2P126), w.s2[rho]);
  }
};

// ct-int4, symmetric (FORMAT.md "ct-int"): codes u = q + 8, one bf16 scale per GROUP columns
// (64: K3; 32: Kimi K2 Thinking). A lane's 32 columns start at a multiple of 32, so they share
// one scale either way. Weight = bf16_rne(q * scale): (128 + u) - 136 = q exactly, then one
// rounded bf16 product, the reference's dequant bit for bit.
template <int GROUP>
struct CtInt4 : Nibbles<CtInt4<GROUP>> {
  static_assert(GROUP % 32 == 0, "a lane's 32 columns must lie in one scale group");
  using N = Nibbles<CtInt4<GROUP>>;
  struct Raw {
    u32 q[2][4];
    u32 s2[2];
    bool has;
  };
  static MTPLX_HD void load(Raw& w, const Mat& m, int tile, int chunk, int lane) {
    const int c0 = N::col0(chunk, lane);
    if (!N::load_codes(w, m, tile, c0, lane)) return;
    const u16* sc = reinterpret_cast<const u16*>(m.scale);
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      const long long r = 16LL * tile + (lane >> 2) + 8 * rho;
      w.s2[rho] = bf16x2_splat(sc[r * (m.cols / GROUP) + c0 / GROUP]);
    }
  }
  static MTPLX_HD u32 pair(const Raw& w, int rho, int word, int jj) {
    const u32 v = N::nib(w.q[rho][word], jj) | 0x43004300u;
    return bf16x2_mul(bf16x2_add(v, MTPLX_BF16X2_NEG136), w.s2[rho]);
  }
};

// ---- ct-int3, symmetric, repacked in device slots -------------------------------------------
//
// A lane owns one 64-column group of each row (lane q: group 4 chunk + q of a 256-column chunk):
// 24 bytes = 6 words per row. The stored dense bit stream (codes 10 and 21 of each 3 words
// straddle words) is repacked in place, group by group (ctint3_repack_group), so that word w
// holds codes 10 w + 2 j (low half) and 10 w + 2 j + 1 (high half) at bits 3 j of each half,
// j < 5, and bit 15 of both halves of words 0-2 (3-5) holds bit k = word index of codes 60, 61
// (62, 63). A pair (codes 2p, 2p + 1) is then one shift and mask; same size as stored.
struct CtInt3 {
  static constexpr int KC = 256, MMAS = 16, UNIT = 1;
  static constexpr bool POST = false;
  static MTPLX_HD int units(int, int) { return MMAS; }
  struct Raw {
    u32 q[2][6];
    u32 s2[2];
    bool has;
  };
  static MTPLX_HD void load(Raw& w, const Mat& m, int tile, int chunk, int lane) {
    const int gi = 4 * chunk + (lane & 3);
    w.has = gi < m.cols / 64;
    if (!w.has) return;
    const long long rowb = 3LL * m.cols / 8;
    const u16* sc = reinterpret_cast<const u16*>(m.scale);
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      const long long r = 16LL * tile + (lane >> 2) + 8 * rho;
      const uint2* p = reinterpret_cast<const uint2*>(m.packed + r * rowb + 24LL * gi);
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const uint2 v = p[k];
        w.q[rho][2 * k] = v.x;
        w.q[rho][2 * k + 1] = v.y;
      }
      w.s2[rho] = bf16x2_splat(sc[r * (m.cols / 64) + gi]);
    }
  }
  // Codes 2p and 2p + 1 as integers in the 16-bit halves.
  static MTPLX_HD u32 field(const u32 (&q)[6], int p) {
    if (p < 30) return (q[p / 5] >> (3 * (p % 5))) & 0x00070007u;
    const int w = p == 30 ? 0 : 3;
    return ((q[w] >> 15) & 0x00010001u) | ((q[w + 1] >> 14) & 0x00020002u) |
           ((q[w + 2] >> 13) & 0x00040004u);
  }
  static MTPLX_HD u32 pair(const Raw& w, int rho, int p) {
    const u32 v = field(w.q[rho], p) | 0x43004300u;
    return bf16x2_mul(bf16x2_add(v, MTPLX_BF16X2_NEG132), w.s2[rho]);
  }
  static MTPLX_HD void frags(const Raw& w, int m, const Ctx&, u32 (&a)[1][4]) {
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      a[0][rho] = w.has ? pair(w, rho, 2 * m) : 0u;
      a[0][2 + rho] = w.has ? pair(w, rho, 2 * m + 1) : 0u;
    }
  }
  static MTPLX_HD int col(int m, int q, int i) { return 64 * q + 4 * m + i; }
};

// Stored dense group (6 words, code s at stream bits 3 s) -> the repacked words above.
MTPLX_HD void ctint3_repack_group(const u32 (&in)[6], u32 (&out)[6]) {
#pragma unroll
  for (int k = 0; k < 6; ++k) out[k] = 0;
#pragma unroll
  for (int s = 0; s < 64; ++s) {
    const int bit = 3 * s, w = bit >> 5, sh = bit & 31;
    u64 pair = in[w];
    if (sh > 29) pair |= (u64)in[w + 1] << 32;
    const u32 code = (u32)(pair >> sh) & 7u;
    if (s < 60) {
      out[s / 10] |= code << (16 * (s & 1) + 3 * ((s % 10) >> 1));
    } else {
      const int m = s - 60;
#pragma unroll
      for (int b = 0; b < 3; ++b) out[3 * (m >> 1) + b] |= ((code >> b) & 1u) << (15 + 16 * (m & 1));
    }
  }
}

// ---- Residents (FORMAT.md "Quantized residents"): int8, fp8 (one scale per row, applied to the
// fp32 sums) and int4 (scale and zero per 32 inputs, folded). Row-major as stored: a lane loads 16
// bytes of each row (16 columns of int8/fp8, lane q: columns 16q .. 16q+15 of a 64-column chunk;
// 32 of int4, as Nibbles). MMA m takes bytes 4m .. 4m+3 of the lane's 16. (Bytes8 also carries
// the fp8-block experts below.)
template <class D>  // the codec: D::pair(word, selector) turns two bytes into a bf16 pair
struct Bytes8 {
  static constexpr int KC = 64, MMAS = 4, UNIT = 1;
  static constexpr bool POST = false;
  static MTPLX_HD int units(int, int) { return MMAS; }
  struct Raw {
    u32 q[2][4];
    bool has;
  };
  // The lane's 16 bytes of both rows, when it holds columns of this chunk (raw.has); returns the
  // lane's first column.
  template <class R>
  static MTPLX_HD int load_bytes(R& w, const Mat& m, int tile, int chunk, int lane) {
    const int c0 = chunk * KC + 16 * (lane & 3);
    w.has = c0 < m.cols;
    if (!w.has) return c0;
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      const long long r = 16LL * tile + (lane >> 2) + 8 * rho;
      const uint4 v = *reinterpret_cast<const uint4*>(m.packed + r * m.cols + c0);
      w.q[rho][0] = v.x, w.q[rho][1] = v.y, w.q[rho][2] = v.z, w.q[rho][3] = v.w;
    }
    return c0;
  }
  static MTPLX_HD void load(Raw& w, const Mat& m, int tile, int chunk, int lane) {
    load_bytes(w, m, tile, chunk, lane);
  }
  static MTPLX_HD int col(int m, int q, int i) { return 16 * q + 4 * m + i; }
  // The bf16 pair of bytes `sel` picks from word m of row rho (a codec with a scale in its Raw
  // defines its own).
  template <class R>
  static MTPLX_HD u32 pair_of(const R& w, int rho, int m, u32 sel) {
    return D::pair(w.q[rho][m], sel);
  }
  template <class R>
  static MTPLX_HD void frags(const R& w, int m, const Ctx&, u32 (&a)[1][4]) {
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      a[0][rho] = w.has ? D::pair_of(w, rho, m, D::SEL_LO) : 0u;      // bytes 0, 1
      a[0][2 + rho] = w.has ? D::pair_of(w, rho, m, D::SEL_HI) : 0u;  // bytes 2, 3
    }
  }
};

// int8 (two's complement): |q| & 127 as bf16 128 + m, plus -128 or -256 by the sign bit: exact.
struct Int8Res : Bytes8<Int8Res> {
  static constexpr u32 SEL_LO = 0x4140u, SEL_HI = 0x4342u;  // bytes to the low byte of a half
  static MTPLX_HD u32 pair(u32 word, u32 sel) {
    const u32 v = prmt(word, 0u, sel);
    return bf16x2_add((v & 0x007F007Fu) | 0x43004300u, (v & 0x00800080u) | 0xC300C300u);
  }
};

// fp8 e4m3fn: sign to bit 15, exponent and mantissa to bits 4..10 (e4m3 * 2^-120, subnormals
// included), times 2^120 exactly.
struct Fp8Res : Bytes8<Fp8Res> {
  static constexpr u32 SEL_LO = 0x1404u, SEL_HI = 0x3424u;  // bytes to the high byte of a half
  static MTPLX_HD u32 pair(u32 word, u32 sel) {
    const u32 v = prmt(word, 0u, sel);
    return bf16x2_mul((v & 0x80008000u) | ((v >> 4) & 0x07F007F0u), MTPLX_BF16X2_2P120);
  }
};

// ---- fp8-block experts (FORMAT.md "fp8-block"), records as stored ---------------------------
//
// e4m3 bytes row-major [rows, cols] and fp32 scale_inv [ceil(rows / 128), ceil(cols / 128)]. A
// lane loads 16 bytes of each of its two rows as the fp8 residents do (lane q: columns 16q ..
// 16q+15 of a 64-column chunk; cols % 16 == 0, cuda.unsupported). 16 divides 128, so a 16-row
// tile lies in one row block and a lane's 16 columns in one column block: one scale per lane and
// chunk. Weight = bf16_rne(fp32(e4m3) * s): the pair made exact bf16 (Fp8Res), each half widened
// to fp32 (exact), multiplied by s in fp32, the pair rounded once: the reference's value bit for
// bit (scaling the fp32 sums instead would skip that rounding).
struct Fp8Block : Bytes8<Fp8Block> {
  static constexpr u32 SEL_LO = Fp8Res::SEL_LO, SEL_HI = Fp8Res::SEL_HI;
  struct Raw {
    u32 q[2][4];
    float s;
    bool has;
  };
  static MTPLX_HD void load(Raw& w, const Mat& m, int tile, int chunk, int lane) {
    const int c0 = load_bytes(w, m, tile, chunk, lane);
    if (!w.has) return;
    const float* sc = reinterpret_cast<const float*>(m.scale);
    w.s = sc[(long long)(tile >> 3) * ((m.cols + 127) / 128) + c0 / 128];  // 8 tiles a block
  }
  static MTPLX_HD u32 pair_of(const Raw& w, int rho, int m, u32 sel) {
    const u32 v = Fp8Res::pair(w.q[rho][m], sel);  // bf16 e4m3 values, exact
    return bf16x2_pack_rn(f32_mul_rn(bits_f32(v << 16), w.s),
                          f32_mul_rn(bits_f32(v & 0xFFFF0000u), w.s));
  }
};

// int4 asymmetric, groups of 32 inputs: weight = bf16_rne((q - 8) * scale + zero), one fma.
// scale and zero are bf16 [K / 32, N] (column-group major, as stored).
struct Int4Res : Nibbles<Int4Res> {
  struct Raw {
    u32 q[2][4];
    u32 s2[2], z2[2];
    bool has;
  };
  static MTPLX_HD void load(Raw& w, const Mat& m, int tile, int chunk, int lane) {
    const int c0 = col0(chunk, lane);
    if (!load_codes(w, m, tile, c0, lane)) return;
    const u16* sc = reinterpret_cast<const u16*>(m.scale);
    const u16* ze = reinterpret_cast<const u16*>(m.zero);
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
      const long long at = (long long)(c0 / 32) * m.rows + 16LL * tile + (lane >> 2) + 8 * rho;
      w.s2[rho] = bf16x2_splat(sc[at]);
      w.z2[rho] = bf16x2_splat(ze[at]);
    }
  }
  static MTPLX_HD u32 pair(const Raw& w, int rho, int word, int jj) {
    const u32 v = nib(w.q[rho][word], jj) | 0x43004300u;
    return bf16x2_fma(bf16x2_add(v, MTPLX_BF16X2_NEG136), w.s2[rho], w.z2[rho]);
  }
};
