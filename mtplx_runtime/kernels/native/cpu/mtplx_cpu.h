/* The exported C ABI of the CPU expert kernels: one shared library (mtplx_cpu, built from every
 * .c file in this folder by mtplx_runtime/kernels/cpu_build.py, loaded by cpu_native.py) for
 * every codec, with one thread pool and one ISA switch. The codec of a call is its first
 * argument, an index into the library's codec table.
 *
 *   int mtplx_cpu_gemm(codec, packed, scale, zero, rows, cols, bits, group, layout, X, n, Y,
 *                      threads)
 *       Y[n, rows] = X[n, cols] · Wᵀ, W one codec matrix.
 *   int mtplx_cpu_expert(codec, mats[9], R, I, bits, group, layout, X, n, out, beta, beta_lin,
 *                        round_model, threads)
 *       out[n, R] = down · SiTU-GLU(gate·x_t, up·x_t) for every token row x_t of X[n, R];
 *       mats = {gate packed, scale, zero, up packed, scale, zero, down packed, scale, zero}.
 *   int mtplx_cpu_layer(codec, mats[9 * n_experts], n_experts, tok_offsets[n_experts + 1],
 *                       tok_index, tok_weight, R, I, bits, group, layout, X, T, acc, beta,
 *                       beta_lin, round_model, threads)
 *       For each expert e in the given order (the caller's ascending id), over its tokens
 *       j in [tok_offsets[e], tok_offsets[e + 1]): y = that expert on row tok_index[j] of
 *       X[T, R], then acc[tok_index[j], :] += y * tok_weight[j] (fp32 product, then fp32 add:
 *       the reference's combine). acc [T, R] fp32 is added into; tok_offsets[0] must be 0.
 *   int mtplx_cpu_situ_glu(g, u, h, n, beta, beta_lin, round_model)
 *       h[i] = SiTU-GLU(g[i], u[i]) for i < n, the experts' activation as the expert calls
 *       compute it (glu.h).
 *   const char *mtplx_cpu_codec_name(int codec)
 *       The codec's name ("t158", "mxfp4", "ct-int", "fp8-block"), NULL past the table. The Python side
 *       (the codec table's cpu column, formats/modes.py) checks these names at load.
 *   int mtplx_cpu_best_isa(void), mtplx_cpu_get_isa(void), mtplx_cpu_set_isa(int want)
 *       0 scalar, 1 avx2, 2 avx512, 3 avx512bf16 (2 plus BW and BF16; the best the CPU
 *       supports unless lowered); one choice for every codec (isa.c).
 *   uint64_t mtplx_cpu_xxh3_64(const void *data, size_t n, uint64_t seed)
 *       XXH3-64 of n bytes with `seed` (xxHash's XXH3_64bits_withSeed; seed 0 is the plain
 *       XXH3_64bits, default secret; checksum.c, on the ISA switch's path): the fast
 *       per-record check of read-time integrity (offload/digests.py).
 * Return codes: 0 ok, -1 bad shape, parameter or codec, -2 out of memory, -3 invalid scale (mxfp4
 * E8M0 0xFF; fp8-block: not finite, or 448 |s| not finite in bf16), -4 invalid weight code
 * (fp8-block: the e4m3 NaN 0x7F or 0xFF; met while decoding, so Y, out or acc then hold NaN
 * where it reached and must be discarded). -1 and -3 are found before any output is written.
 * bits, group and layout are read by ct-int only (bits 3 or 4; group: columns per scale, 64 or
 * 32; layout 0 dense, 1 legacy 3-bit).
 *
 * Numerics: every dot product accumulates in fp32. The weights a kernel multiplies are the
 * exact values the NumPy codec decodes, so only the fp32 summation order differs from "decode,
 * then matmul" (mxfp4 on avx512bf16 multiplies a bf16 input row by the unscaled E2M1 values,
 * exactly, and scales each 32-column group's partial sums by its exact power of two). Per token the arithmetic does not depend on n, the thread count or the row
 * chunking, so an n-token call equals n one-token calls bit for bit. round_model = 1 mirrors a
 * bf16 model (model/layers.py glu_mlp): gate·x and up·x rounded to bf16, SiTU-GLU in fp32 then
 * rounded, down·h rounded; round_model = 0 is an fp32 model (nothing rounded).
 */
#ifndef MTPLX_CPU_H
#define MTPLX_CPU_H

/* The library is built with -fvisibility=hidden: only these names are exported. */
#define MTPLX_API __attribute__((visibility("default")))

#include <stddef.h>
#include <stdint.h>

/* In the order of the codec table's cpu column (formats/modes.py cpu_codecs). */
enum mtplx_codec {
    MTPLX_CODEC_T158,
    MTPLX_CODEC_MXFP4,
    MTPLX_CODEC_CTINT,
    MTPLX_CODEC_FP8,
    MTPLX_CODECS
};

MTPLX_API int mtplx_cpu_gemm(int codec, const void *packed, const void *scale, const void *zero,
                             int rows, int cols, int bits, int group, int layout, const float *X,
                             int n, float *Y, int threads);
MTPLX_API int mtplx_cpu_expert(int codec, const void *const *mats, int R, int I, int bits,
                               int group, int layout, const float *X, int n, float *out,
                               float beta, float beta_lin, int round_model, int threads);
MTPLX_API int mtplx_cpu_layer(int codec, const void *const *mats, int n_experts,
                              const int *tok_offsets, const int *tok_index,
                              const float *tok_weight, int R, int I, int bits, int group,
                              int layout, const float *X, int T, float *acc, float beta,
                              float beta_lin, int round_model, int threads);
MTPLX_API int mtplx_cpu_situ_glu(const float *g, const float *u, float *h, int n, float beta,
                                 float beta_lin, int round_model);
MTPLX_API const char *mtplx_cpu_codec_name(int codec);
MTPLX_API int mtplx_cpu_best_isa(void);
MTPLX_API int mtplx_cpu_set_isa(int want);
MTPLX_API int mtplx_cpu_get_isa(void);
MTPLX_API uint64_t mtplx_cpu_xxh3_64(const void *data, size_t n, uint64_t seed);

#endif
