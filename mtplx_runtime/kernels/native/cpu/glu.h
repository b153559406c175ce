/* SiTU-GLU, the routed experts' activation, over rows of gate and up outputs (glu.c). */
#ifndef MTPLX_GLU_H
#define MTPLX_GLU_H

/* h[i] = beta tanh(g[i] / beta) sigmoid(g[i]) * beta_lin tanh(u[i] / beta_lin) for i < n, in
 * fp32 (g, u rounded to bf16 first and h after when round_model); a beta of +inf stands for the
 * limit, beta tanh(v / beta) -> v (SiLU-GLU at both). Every ISA gives the same
 * bits: the AVX-512 loop (isa >= 2) and the scalar one (built with FMA for isa 1) do the same
 * IEEE operations. */
void situ_glu_rows(const float *g, const float *u, float *h, int n, float beta, float beta_lin,
                   int round_model, int isa);

#endif
