/* t16f, the avx512 t158 row kernel (t158_t16f.c): per-input-vector tables, then 32 rows at a
 * time, 16 in the zmm lanes. Needs AVX-512 F/BW/DQ; callers check before calling. */
#ifndef MTPLX_T158_T16F_H
#define MTPLX_T158_T16F_H

#include <stddef.h>
#include <stdint.h>

#define T16F_TGT __attribute__((target("avx512f,avx512bw,avx512dq")))
#define T16F_TAB_FLOATS(G) ((size_t)(G) * 13 * 48) /* tables of one input vector */
/* scratch t16f_span needs, in floats: the transposed scales of two 16-row blocks, 2 x 16 x (G
 * rounded up to 4) fp32, then a zero-padded 32-row copy of the rows left after the last whole
 * 32 (32 x 13G bytes + 32 x G bf16, 64 bytes of pad) and its 32 results. */
#define T16F_ST_FLOATS(G) ((size_t)16 * (((G) + 3) / 4 * 4))
#define T16F_SCRATCH_FLOATS(G) (2 * T16F_ST_FLOATS(G) + (size_t)8 * (G) * 15 + 16 + 32)

/* Once (pthread_once) before any other call: fills the constant trit tables. */
void t16f_init(void);
/* The tables of input vector x[0 .. 64G) into tab (T16F_TAB_FLOATS(G) floats, 64-byte
 * aligned). */
T16F_TGT void t16f_tables(const float *x, int G, float *tab);
/* y[r] for r in [r0, r1) of the [rows, 64G] matrix at pk (13G bytes a row) with bf16 scales sc
 * [rows, G], through the tables of one input vector. pf_end: rows below it may be prefetched.
 * scratch: T16F_SCRATCH_FLOATS(G) floats, 64-byte aligned. */
T16F_TGT void t16f_span(const uint8_t *pk, const uint16_t *sc, int G, const float *tab, float *y,
                        int r0, int r1, int pf_end, float *scratch);

#endif
