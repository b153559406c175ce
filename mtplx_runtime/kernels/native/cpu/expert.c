/* The driver of the CPU expert library: the codec table, the ISA switch, and the multi-token
 * GEMM / expert-MLP / layer pipeline behind the exported C ABI (mtplx_cpu.h). A codec source
 * (t158.c, mxfp4.c, ctint.c) supplies two hooks, prepare and rows (cpu_common.h); everything
 * else (threads through thread_pool.c, SiTU-GLU, model rounding) is shared, so every codec
 * behaves the same. */
#include "cpu_common.h"
#include "thread_pool.h"

/* SiTU-GLU in fp32 with the reference's operation order (model/layers.py situ_glu). */
static inline float situ_glu(float g, float u, float beta, float beta_lin) {
    float sig = 1.0f / (1.0f + expf(-g));
    return beta * tanhf(g / beta) * sig * (beta_lin * tanhf(u / beta_lin));
}

/* ---- the codec table: index = enum mtplx_codec, every entry point's first argument ---- */

static const struct {
    const char *name; /* the name cpu_native.py uses */
    int (*prepare)(mat_t *m);
    rows_fn (*rows)(const mat_t *m, int isa);
} CODECS[MTPLX_CODECS] = {
    [MTPLX_CODEC_T158] = {"t158", t158_prepare, t158_rows},
    [MTPLX_CODEC_MXFP4] = {"mxfp4", mxfp4_prepare, mxfp4_rows},
    [MTPLX_CODEC_CTINT] = {"ct-int", ctint_prepare, ctint_rows},
};

const char *mtplx_cpu_codec_name(int codec) {
    return codec >= 0 && codec < MTPLX_CODECS ? CODECS[codec].name : NULL;
}

static rows_fn codec_rows(const mat_t *m, int isa) { return CODECS[m->codec].rows(m, isa); }

/* ---- ISA selection: one portable build, variants behind per-function target attributes ---- */

static int g_isa = -1;

int mtplx_cpu_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
        if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16")) return 3;
        return 2;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* Select path min(want, best); want < 0 means best. Returns the path now in use. */
int mtplx_cpu_set_isa(int want) {
    int best = mtplx_cpu_best_isa();
    g_isa = (want < 0 || want > best) ? best : want;
    return g_isa;
}

int mtplx_cpu_get_isa(void) {
    if (g_isa < 0) mtplx_cpu_set_isa(-1);
    return g_isa;
}

/* ---- the pipeline ---- */

/* Rows [r0, r1) of chunk c of `rows` split in `n` pieces, each a multiple of 16 rows: t158's
 * avx512 kernel runs 16-row blocks and pads a shorter tail, so aligned chunks save that work
 * (results never depend on the chunking; every row kernel computes a row on its own). */
static void chunk_rows(int rows, int n, int c, int *r0, int *r1) {
    int step = (rows + n - 1) / n;
    step = (step + 15) & ~15;
    *r0 = c * step < rows ? c * step : rows;
    *r1 = (c + 1) * step < rows ? (c + 1) * step : rows;
}

static int clamp_threads(int threads, int rows) {
    int most = (rows + 1) / 2;
    if (threads > most) threads = most;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    return threads < 1 ? 1 : threads;
}

/* Chunks per thread of a region: enough that a thread preempted mid-region leaves most of its
 * share to the others, few enough that each chunk stays hundreds of rows long. */
#define CHUNKS_PER_THREAD 4

/* Chunks for `threads` threads over `rows` rows: CHUNKS_PER_THREAD each, at most one per 16
 * rows (chunk_rows' granule). */
static int clamp_chunks(int threads, int rows) {
    int most = (rows + 15) / 16;
    int n = threads > 1 ? threads * CHUNKS_PER_THREAD : 1;
    return n < most ? n : (most < 1 ? 1 : most);
}

/* Input row stride: a multiple of 16 floats with at least XPAD zeros after each row. */
static inline int padded_ld(int cols) { return (cols + XPAD + 15) / 16 * 16; }

/* Rows idx[0..n) of X[., cols] (rows 0..n-1 when idx is NULL) into p with row stride ld (the
 * padding after each row zero): the 64-byte aligned input the row kernels read. */
static void gather_rows(float *p, int ld, const float *X, const int *idx, int n, int cols) {
    for (int t = 0; t < n; t++) {
        memcpy(p + (size_t)t * ld, X + (size_t)(idx ? idx[t] : t) * cols, (size_t)cols * 4);
        memset(p + (size_t)t * ld + cols, 0, (size_t)(ld - cols) * 4);
    }
}

typedef struct {
    rows_fn fn;
    const mat_t *m;
    const float *X;
    int ldx, n, nchunks;
    float *Y, *scratch; /* scratch: one block per chunk */
    int ldy;
} gemm_job;

static void gemm_chunk(void *arg, int c) {
    const gemm_job *j = arg;
    int r0, r1;
    chunk_rows(j->m->rows, j->nchunks, c, &r0, &r1);
    if (r1 > r0)
        j->fn(j->m, j->X, j->ldx, j->n, j->Y, j->ldy, r0, r1,
              j->scratch + c * scratch_floats(j->m->cols));
}

static int prepare(mat_t *m) {
    if (m->codec < 0 || m->codec >= MTPLX_CODECS) return -1;
    if (m->rows <= 0 || m->cols <= 0 || m->cols % BLOCK) return -1;
    return CODECS[m->codec].prepare(m);
}

int mtplx_cpu_gemm(int codec, const void *packed, const void *scale, const void *zero, int rows,
                   int cols, int bits, int layout, const float *X, int n, float *Y, int threads) {
    mat_t m = {packed, scale, zero, rows, cols, bits, layout, 0, 0, codec};
    int rc = prepare(&m);
    if (rc) return rc;
    if (n <= 0) return -1;
    int ldx = padded_ld(cols);
    threads = clamp_threads(threads, rows);
    int chunks = clamp_chunks(threads, rows);
    float *xp = aligned_alloc(64, (size_t)n * ldx * 4);
    float *scratch = aligned_alloc(64, chunks * scratch_floats(cols) * 4);
    if (!xp || !scratch) {
        free(xp), free(scratch);
        return -2;
    }
    gather_rows(xp, ldx, X, NULL, n, cols);
    gemm_job j = {codec_rows(&m, mtplx_cpu_get_isa()), &m, xp, ldx, n, chunks, Y, scratch,
                  rows};
    run_chunks(gemm_chunk, &j, chunks, threads);
    free(xp), free(scratch);
    return 0;
}

/* One expert over n gathered token rows X. With acc NULL the output is out[n, R]
 * (mtplx_cpu_expert); else (mtplx_cpu_layer) out is a scratch [n, R] and each down chunk adds
 * wt[t] * out[t, r] into acc[tok[t], r] for its rows r. */
typedef struct {
    rows_fn fn_in, fn_down;
    const mat_t *gate, *up, *down;
    /* X: the gathered input rows; scratch: one block per chunk, for the wider of R, I */
    float *X, *G, *U, *H, *out, *scratch;
    int ldx, ldh, n, R, I, round_model, nchunks, nthreads;
    float beta, beta_lin;
    const int *tok;
    const float *wt;
    float *acc;
} expert_job;

/* Gate and up rows of this chunk for every token, then SiTU-GLU on the same rows: h[t, i]
 * needs only gate row i and up row i, so no barrier is needed before the activation. */
static void gate_up_chunk(void *arg, int c) {
    const expert_job *j = arg;
    int r0, r1;
    chunk_rows(j->I, j->nchunks, c, &r0, &r1);
    if (r1 <= r0) return;
    float *scratch = j->scratch + c * scratch_floats(j->R > j->I ? j->R : j->I);
    j->fn_in(j->gate, j->X, j->ldx, j->n, j->G, j->ldh, r0, r1, scratch);
    j->fn_in(j->up, j->X, j->ldx, j->n, j->U, j->ldh, r0, r1, scratch);
    for (int t = 0; t < j->n; t++) {
        const float *g = j->G + (size_t)t * j->ldh, *u = j->U + (size_t)t * j->ldh;
        float *h = j->H + (size_t)t * j->ldh;
        for (int i = r0; i < r1; i++) {
            float gi = g[i], ui = u[i];
            if (j->round_model) gi = round_bf16(gi), ui = round_bf16(ui);
            float v = situ_glu(gi, ui, j->beta, j->beta_lin);
            h[i] = j->round_model ? round_bf16(v) : v;
        }
    }
}

static void down_chunk(void *arg, int c) {
    const expert_job *j = arg;
    int r0, r1;
    chunk_rows(j->R, j->nchunks, c, &r0, &r1);
    if (r1 <= r0) return;
    j->fn_down(j->down, j->H, j->ldh, j->n, j->out, j->R, r0, r1,
               j->scratch + c * scratch_floats(j->R > j->I ? j->R : j->I));
    if (j->round_model)
        for (int t = 0; t < j->n; t++)
            for (int r = r0; r < r1; r++) {
                float *y = j->out + (size_t)t * j->R + r;
                *y = round_bf16(*y);
            }
    /* The reference's combine (index_add_ of weight * y): an fp32 product, then an fp32 add,
     * one per (token, row); the rows are this chunk's own, so chunks never touch the same acc
     * element. */
    if (j->acc)
        for (int t = 0; t < j->n; t++) {
            const float *y = j->out + (size_t)t * j->R;
            float w = j->wt[t], *a = j->acc + (size_t)j->tok[t] * j->R;
            for (int r = r0; r < r1; r++) a[r] += y[r] * w;
        }
}

/* gate, up, down of one expert from mats[9], checked. */
static int prepare_expert(int codec, const void *const *mats, int R, int I, int bits, int layout,
                          mat_t m[3]) {
    m[0] = (mat_t){mats[0], mats[1], mats[2], I, R, bits, layout, 0, 0, codec};
    m[1] = (mat_t){mats[3], mats[4], mats[5], I, R, bits, layout, 0, 0, codec};
    m[2] = (mat_t){mats[6], mats[7], mats[8], R, I, bits, layout, 0, 0, codec};
    int rc;
    if ((rc = prepare(&m[0])) || (rc = prepare(&m[1])) || (rc = prepare(&m[2]))) return rc;
    return 0;
}

static void job_free(expert_job *j) { free(j->X), free(j->G), free(j->scratch); }

/* The job's buffers for up to n tokens (j->R, j->I set); one set serves every expert of a
 * layer call. */
static int job_alloc(expert_job *j, int n, int threads) {
    int R = j->R, I = j->I;
    j->ldx = padded_ld(R), j->ldh = padded_ld(I);
    j->nthreads = clamp_threads(threads, R < I ? R : I);
    j->nchunks = clamp_chunks(j->nthreads, R < I ? R : I); /* every region has this many */
    size_t h = (size_t)n * j->ldh;
    j->X = aligned_alloc(64, (size_t)n * j->ldx * 4);
    j->G = aligned_alloc(64, 3 * h * 4);
    j->scratch = aligned_alloc(64, j->nchunks * scratch_floats(R > I ? R : I) * 4);
    if (!j->X || !j->G || !j->scratch) {
        job_free(j);
        return -2;
    }
    /* G, U are fully written for columns < I; H's pad columns must read as zeros (and stay
     * so: no expert writes them). */
    memset(j->G, 0, 3 * h * 4);
    j->U = j->G + h, j->H = j->G + 2 * h;
    return 0;
}

/* Expert m[3] over the n rows already gathered into j->X: two pool regions. */
static void job_run(expert_job *j, const mat_t *m, int n) {
    int isa = mtplx_cpu_get_isa();
    j->gate = &m[0], j->up = &m[1], j->down = &m[2], j->n = n;
    j->fn_in = codec_rows(&m[0], isa), j->fn_down = codec_rows(&m[2], isa);
    run_chunks(gate_up_chunk, j, j->nchunks, j->nthreads);
    run_chunks(down_chunk, j, j->nchunks, j->nthreads);
}

int mtplx_cpu_expert(int codec, const void *const *mats, int R, int I, int bits, int layout,
                     const float *X, int n, float *out, float beta, float beta_lin,
                     int round_model, int threads) {
    mat_t m[3];
    int rc = prepare_expert(codec, mats, R, I, bits, layout, m);
    if (rc) return rc;
    if (n <= 0) return -1;
    expert_job j = {.R = R, .I = I, .round_model = round_model, .beta = beta,
                    .beta_lin = beta_lin, .out = out};
    if ((rc = job_alloc(&j, n, threads))) return rc;
    gather_rows(j.X, j.ldx, X, NULL, n, R);
    job_run(&j, m, n);
    job_free(&j);
    return 0;
}

/* A layer window in one call, so the caller makes no per-expert round trip (why: BENCHMARKS.md,
 * "CPU kernel notes"). Every matrix is checked before acc is touched. */
int mtplx_cpu_layer(int codec, const void *const *mats, int n_experts, const int *tok_offsets,
                    const int *tok_index, const float *tok_weight, int R, int I, int bits,
                    int layout, const float *X, int T, float *acc, float beta, float beta_lin,
                    int round_model, int threads) {
    if (codec < 0 || codec >= MTPLX_CODECS || n_experts < 0 || T <= 0 || tok_offsets[0] != 0)
        return -1;
    if (n_experts == 0) return 0;
    int nmax = 0;
    for (int e = 0; e < n_experts; e++) {
        int n = tok_offsets[e + 1] - tok_offsets[e];
        if (n < 0) return -1;
        if (n > nmax) nmax = n;
    }
    for (int k = 0; k < tok_offsets[n_experts]; k++)
        if (tok_index[k] < 0 || tok_index[k] >= T) return -1;
    mat_t *m = malloc((size_t)n_experts * 3 * sizeof *m);
    if (!m) return -2;
    int rc = 0;
    for (int e = 0; e < n_experts && !rc; e++)
        rc = prepare_expert(codec, mats + (size_t)9 * e, R, I, bits, layout, m + 3 * e);
    expert_job j = {.R = R, .I = I, .round_model = round_model, .beta = beta,
                    .beta_lin = beta_lin, .acc = acc};
    if (!rc && nmax && !(rc = job_alloc(&j, nmax, threads))) {
        if ((j.out = malloc((size_t)nmax * R * 4))) {
            for (int e = 0; e < n_experts; e++) { /* in the caller's (ascending id) order */
                int off = tok_offsets[e], n = tok_offsets[e + 1] - off;
                if (!n) continue;
                j.tok = tok_index + off, j.wt = tok_weight + off;
                gather_rows(j.X, j.ldx, X, j.tok, n, R);
                job_run(&j, m + 3 * e, n);
            }
            free(j.out);
        } else {
            rc = -2;
        }
        job_free(&j);
    }
    free(m);
    return rc;
}
