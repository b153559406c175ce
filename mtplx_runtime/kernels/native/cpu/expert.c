/* The driver of the CPU expert library: the codec table and the multi-token GEMM / expert-MLP /
 * layer pipeline behind the exported C ABI (mtplx_cpu.h). A codec source (t158.c, mxfp4.c,
 * ctint.c, fp8block.c) supplies two hooks, prepare and rows (cpu_common.h); everything else
 * (threads through thread_pool.c, the ISA switch in isa.c, SiTU-GLU, model rounding) is shared,
 * so every codec behaves the same. */
#include <sched.h>
#include <stdatomic.h>

#include "cpu_common.h"
#include "glu.h"
#include "thread_pool.h"

/* ---- the codec table: index = enum mtplx_codec, every entry point's first argument ---- */

static const struct {
    const char *name; /* the name cpu_native.py uses */
    int (*prepare)(mat_t *m);
    rows_fn (*rows)(const mat_t *m, int isa);
    const input_stage *input; /* NULL: none */
} CODECS[MTPLX_CODECS] = {
    [MTPLX_CODEC_T158] = {"t158", t158_prepare, t158_rows, &T158_INPUT},
    [MTPLX_CODEC_MXFP4] = {"mxfp4", mxfp4_prepare, mxfp4_rows, NULL},
    [MTPLX_CODEC_CTINT] = {"ct-int", ctint_prepare, ctint_rows, NULL},
    [MTPLX_CODEC_FP8] = {"fp8-block", fp8_prepare, fp8_rows, NULL},
};

const char *mtplx_cpu_codec_name(int codec) {
    return codec >= 0 && codec < MTPLX_CODECS ? CODECS[codec].name : NULL;
}

static rows_fn codec_rows(const mat_t *m, int isa) { return CODECS[m->codec].rows(m, isa); }

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
                   int cols, int bits, int group, int layout, const float *X, int n, float *Y,
                   int threads) {
    int bad = 0; /* raised by a decoder that meets an invalid code (mtplx_cpu.h: -4) */
    mat_t m = {packed, scale, zero, rows, cols, bits, layout, 0, 0, codec, &bad, group};
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
    return __atomic_load_n(&bad, __ATOMIC_RELAXED) ? -4 : 0;
}

/* ---- the expert pipeline: one pool region per call (mtplx_cpu_expert: one expert;
 * mtplx_cpu_layer: a window) ----
 *
 * Each expert e is three kinds of task: gather (its token rows of X into an input set), its
 * gate/up chunks (rows of G, U and H = SiTU-GLU(G, U)) and its down chunks (rows of y, added into
 * acc). Threads claim tasks in the order gather(e), gate_up(e), down(e - lag), so down(e - 1)
 * computes while gate_up(e) does, and a region ends once per call instead of twice per expert
 * (each end idles a thread for about half a chunk: benchmarks log, "One region per layer"). A
 * task waits, spinning, for the tasks whose results it reads or whose buffers it reuses, always
 * ones claimed before it, so claiming in order cannot deadlock:
 *   gather(e):     gate_up(e - depth) done        (it overwrites that expert's input set)
 *   gate_up(e, c): gather(e), down(e - depth) done (it overwrites that expert's G, U, H)
 *   down(e, c):    gate_up(e) done (every column of h), down(e - 1) done (acc in expert order)
 * Every row goes through the same row kernel and combine as in a one-thread run, so results do
 * not depend on threads, chunking or the interleaving. */

typedef struct {
    mat_t m[3];     /* gate, up, down */
    const int *tok; /* rows of X for its tokens; NULL: rows 0 .. n-1 */
    const float *wt;
    int n;
    atomic_int gathered, gu_done, d_done; /* 0 or 1; chunks done; chunks done */
} pipe_expert;

typedef struct {
    rows_fn fn_in, fn_down;
    const input_stage *stage; /* the codec's, or NULL */
    uint64_t call;            /* this call's number (the input stage cache's key) */
    pipe_expert *ex;
    int E, depth, lag, nch, nmax, ldx, ldh, R, I, round_model, isa;
    const float *X; /* the caller's rows [., R] */
    float *sets;    /* depth sets, each X [nmax, ldx] then G, U, H [nmax, ldh] */
    float *out;     /* [nmax, R]: the caller's output (expert) or scratch (layer) */
    float *acc;     /* NULL: mtplx_cpu_expert */
    float beta, beta_lin;
    uint32_t *task; /* task i: kind << 30 | e << 12 | chunk */
    atomic_int failed;
} pipe_job;

enum { TASK_GATHER, TASK_GATE_UP, TASK_DOWN };

/* kind << 30 | expert << 12 | chunk: chunk < 4096 (clamp_chunks: MAX_THREADS *
 * CHUNKS_PER_THREAD), expert < 2^18 (mtplx_cpu_layer checks) */
static uint32_t task_code(int kind, int e, int c) {
    return (uint32_t)kind << 30 | (uint32_t)e << 12 | (uint32_t)c;
}

static size_t set_floats(const pipe_job *p) {
    return (size_t)p->nmax * ((size_t)p->ldx + 3 * (size_t)p->ldh);
}
static float *set_x(const pipe_job *p, int e) { return p->sets + (e % p->depth) * set_floats(p); }
/* G, U, H of expert e's set: three [nmax, ldh] after its X */
static float *set_g(const pipe_job *p, int e) { return set_x(p, e) + (size_t)p->nmax * p->ldx; }

/* Spin until *c reaches target, yielding now and then, so a thread whose producer lost its CPU
 * gives the CPU back. */
static void wait_count(atomic_int *c, int target) {
    for (unsigned i = 0; atomic_load_explicit(c, memory_order_acquire) < target; i++) {
        _mm_pause();
        if ((i & 1023) == 1023) sched_yield();
    }
}

/* Calls so far, numbering each so that a thread's cached input stage is never taken for another
 * call's input; this thread's cached stages (0: x, 1: h) and the (call, expert) they hold. */
static atomic_uint_fast64_t pipe_calls;
static _Thread_local struct {
    uint64_t call;
    int e;
} stage_key[2];

/* Expert e's input `which` (0: x, read by gate and up; 1: h, read by down) through the codec's
 * input stage, built on this thread's first use and reused by its later chunks of that input:
 * NULL where the codec has no stage at this size and ISA, or out of memory (use the rows_fn). */
static const float *staged(const pipe_job *p, int e, int which, const mat_t *m, const float *in,
                           int ld) {
    int n = p->ex[e].n;
    size_t f = p->stage ? p->stage->floats(m, n, p->isa) : 0;
    float *buf = f ? thread_floats(which ? THREAD_BUF_STAGE_DOWN : THREAD_BUF_STAGE_IN, f) : NULL;
    if (!buf) {
        stage_key[which].call = 0; /* a failed thread_floats may have freed what it held */
        return NULL;
    }
    if (stage_key[which].call != p->call || stage_key[which].e != e) {
        p->stage->build(m, in, ld, n, buf);
        stage_key[which].call = p->call, stage_key[which].e = e;
    }
    return buf;
}

/* The row kernels' scratch: per thread, since tasks of the same chunk index (of two experts)
 * may run at once. */
static float *task_scratch(pipe_job *p) {
    float *s = thread_floats(THREAD_BUF_ROW_SCRATCH, scratch_floats(p->R > p->I ? p->R : p->I));
    if (!s) atomic_store(&p->failed, 1);
    return s;
}

/* Gate and up rows of this chunk for every token, then SiTU-GLU on the same rows: h[t, i]
 * needs only gate row i and up row i, so no other chunk's result is needed. */
static void gate_up_task(pipe_job *p, int e, int c) {
    const pipe_expert *x = p->ex + e;
    int r0, r1;
    chunk_rows(p->I, p->nch, c, &r0, &r1);
    float *scratch = task_scratch(p);
    if (r1 <= r0 || !scratch) return;
    size_t h = (size_t)p->nmax * p->ldh;
    float *X = set_x(p, e), *G = set_g(p, e), *U = G + h, *H = U + h;
    const float *in = staged(p, e, 0, &x->m[0], X, p->ldx);
    if (in) {
        p->stage->rows(&x->m[0], in, x->n, G, p->ldh, r0, r1, scratch);
        p->stage->rows(&x->m[1], in, x->n, U, p->ldh, r0, r1, scratch);
    } else {
        p->fn_in(&x->m[0], X, p->ldx, x->n, G, p->ldh, r0, r1, scratch);
        p->fn_in(&x->m[1], X, p->ldx, x->n, U, p->ldh, r0, r1, scratch);
    }
    for (int t = 0; t < x->n; t++) {
        size_t o = (size_t)t * p->ldh + r0;
        situ_glu_rows(G + o, U + o, H + o, r1 - r0, p->beta, p->beta_lin, p->round_model, p->isa);
    }
}

static void down_task(pipe_job *p, int e, int c) {
    const pipe_expert *x = p->ex + e;
    int r0, r1;
    chunk_rows(p->R, p->nch, c, &r0, &r1);
    float *scratch = task_scratch(p);
    if (r1 <= r0 || !scratch) return;
    float *H = set_g(p, e) + 2 * (size_t)p->nmax * p->ldh;
    const float *in = staged(p, e, 1, &x->m[2], H, p->ldh);
    if (in)
        p->stage->rows(&x->m[2], in, x->n, p->out, p->R, r0, r1, scratch);
    else
        p->fn_down(&x->m[2], H, p->ldh, x->n, p->out, p->R, r0, r1, scratch);
    if (p->round_model)
        for (int t = 0; t < x->n; t++)
            for (int r = r0; r < r1; r++) {
                float *y = p->out + (size_t)t * p->R + r;
                *y = round_bf16(*y);
            }
    /* The reference's combine (index_add_ of weight * y): an fp32 product, then an fp32 add,
     * one per (token, row); the rows are this chunk's own, so chunks never touch the same acc
     * element, and down(e - 1) finished before this began. */
    if (p->acc)
        for (int t = 0; t < x->n; t++) {
            const float *y = p->out + (size_t)t * p->R;
            float w = x->wt[t], *a = p->acc + (size_t)x->tok[t] * p->R;
            for (int r = r0; r < r1; r++) a[r] += y[r] * w;
        }
}

static void pipe_task(void *arg, int i) {
    pipe_job *p = arg;
    uint32_t t = p->task[i];
    int kind = (int)(t >> 30), e = (int)(t >> 12 & 0x3FFFF), c = (int)(t & 0xFFF);
    pipe_expert *x = p->ex + e;
    if (kind == TASK_GATHER) {
        if (e >= p->depth) wait_count(&p->ex[e - p->depth].gu_done, p->nch);
        gather_rows(set_x(p, e), p->ldx, p->X, x->tok, x->n, p->R);
        atomic_store_explicit(&x->gathered, 1, memory_order_release);
    } else if (kind == TASK_GATE_UP) {
        wait_count(&x->gathered, 1);
        if (e >= p->depth) wait_count(&p->ex[e - p->depth].d_done, p->nch);
        gate_up_task(p, e, c);
        atomic_fetch_add_explicit(&x->gu_done, 1, memory_order_release);
    } else {
        wait_count(&x->gu_done, p->nch);
        if (e > 0) wait_count(&p->ex[e - 1].d_done, p->nch);
        down_task(p, e, c);
        atomic_fetch_add_explicit(&x->d_done, 1, memory_order_release);
    }
}

/* Run the prepared experts p->ex[0 .. E) (m, tok, wt, n set) over the caller's X into out /
 * acc: the task order, the buffers, one region. 0, or -2 when out of memory. */
static int pipe_run(pipe_job *p, int threads) {
    int E = p->E, nmax = 0;
    for (int e = 0; e < E; e++) nmax = p->ex[e].n > nmax ? p->ex[e].n : nmax;
    if (!nmax) return 0;
    int isa = p->isa = mtplx_cpu_get_isa();
    p->fn_in = codec_rows(&p->ex[0].m[0], isa), p->fn_down = codec_rows(&p->ex[0].m[2], isa);
    p->stage = CODECS[p->ex[0].m[0].codec].input;
    p->call = atomic_fetch_add(&pipe_calls, 1) + 1;
    p->nmax = nmax, p->ldx = padded_ld(p->R), p->ldh = padded_ld(p->I);
    threads = clamp_threads(threads, p->R < p->I ? p->R : p->I);
    p->nch = clamp_chunks(threads, p->R < p->I ? p->R : p->I);
    /* Three sets: gate_up(e) runs beside down(e - 1) and reuses the set of e - 3, whose down
     * chunks were claimed a whole step earlier (with two, it would wait on down(e - 2), claimed
     * just before it). One set (lag 0, no overlap) if three do not fit. */
    /* The sets live in the calling thread's buffer, kept across calls: decode makes a call per
     * landed expert, and a fresh allocation this size would be an mmap plus page faults. */
    p->depth = E < 3 ? E : 3;
    p->sets = thread_floats(THREAD_BUF_PIPE_SETS, p->depth * set_floats(p));
    if (!p->sets && p->depth > 1)
        p->depth = 1, p->sets = thread_floats(THREAD_BUF_PIPE_SETS, set_floats(p));
    p->lag = p->depth > 1 ? 1 : 0;
    int per = 1 + 2 * p->nch, n = 0;
    p->task = malloc((size_t)E * per * sizeof *p->task);
    if (!p->sets || !p->task) {
        free(p->task);
        return -2;
    }
    /* X's pad columns are zeroed by the gather, and G, U, H are written for every column < I;
     * H's pad columns must read as zeros, as every input row's must (XPAD, cpu_common.h), and
     * no task writes them */
    for (int d = 0; d < p->depth; d++) {
        float *H = set_g(p, d) + 2 * (size_t)nmax * p->ldh;
        for (int t = 0; t < nmax; t++)
            memset(H + (size_t)t * p->ldh + p->I, 0, (size_t)(p->ldh - p->I) * 4);
    }
    for (int s = 0; s < E + p->lag; s++) {
        if (s < E) {
            p->task[n++] = task_code(TASK_GATHER, s, 0);
            for (int c = 0; c < p->nch; c++) p->task[n++] = task_code(TASK_GATE_UP, s, c);
        }
        if (s >= p->lag)
            for (int c = 0; c < p->nch; c++) p->task[n++] = task_code(TASK_DOWN, s - p->lag, c);
    }
    atomic_init(&p->failed, 0);
    run_chunks(pipe_task, p, n, threads);
    free(p->task);
    return atomic_load(&p->failed) ? -2 : 0;
}

/* gate, up, down of one expert from mats[9], checked; their decoders raise *bad. */
static int prepare_expert(int codec, const void *const *mats, int R, int I, int bits, int group,
                          int layout, int *bad, mat_t m[3]) {
    m[0] = (mat_t){mats[0], mats[1], mats[2], I, R, bits, layout, 0, 0, codec, bad, group};
    m[1] = (mat_t){mats[3], mats[4], mats[5], I, R, bits, layout, 0, 0, codec, bad, group};
    m[2] = (mat_t){mats[6], mats[7], mats[8], R, I, bits, layout, 0, 0, codec, bad, group};
    int rc;
    if ((rc = prepare(&m[0])) || (rc = prepare(&m[1])) || (rc = prepare(&m[2]))) return rc;
    return 0;
}

int mtplx_cpu_expert(int codec, const void *const *mats, int R, int I, int bits, int group,
                     int layout, const float *X, int n, float *out, float beta, float beta_lin,
                     int round_model, int threads) {
    pipe_expert x = {.n = n};
    atomic_init(&x.gathered, 0), atomic_init(&x.gu_done, 0), atomic_init(&x.d_done, 0);
    int bad = 0;
    int rc = prepare_expert(codec, mats, R, I, bits, group, layout, &bad, x.m);
    if (rc) return rc;
    if (n <= 0) return -1;
    pipe_job p = {.ex = &x, .E = 1, .R = R, .I = I, .round_model = round_model, .X = X,
                  .out = out, .beta = beta, .beta_lin = beta_lin};
    rc = pipe_run(&p, threads);
    return rc ? rc : __atomic_load_n(&bad, __ATOMIC_RELAXED) ? -4 : 0;
}

/* A layer window in one call, so the caller makes no per-expert round trip (why: benchmarks log,
 * "CPU kernel notes"). Every matrix is checked before acc is touched. */
int mtplx_cpu_layer(int codec, const void *const *mats, int n_experts, const int *tok_offsets,
                    const int *tok_index, const float *tok_weight, int R, int I, int bits,
                    int group, int layout, const float *X, int T, float *acc, float beta,
                    float beta_lin, int round_model, int threads) {
    if (codec < 0 || codec >= MTPLX_CODECS || n_experts < 0 || n_experts >= 1 << 18 || T <= 0 ||
        tok_offsets[0] != 0)
        return -1;
    if (n_experts == 0) return 0;
    for (int e = 0; e < n_experts; e++)
        if (tok_offsets[e + 1] < tok_offsets[e]) return -1;
    for (int k = 0; k < tok_offsets[n_experts]; k++)
        if (tok_index[k] < 0 || tok_index[k] >= T) return -1;
    /* experts with no tokens are checked, then left out of the task list */
    pipe_expert *ex = malloc((size_t)n_experts * sizeof *ex);
    if (!ex) return -2;
    int rc = 0, E = 0, nmax = 0, bad = 0;
    for (int e = 0; e < n_experts && !rc; e++) {
        pipe_expert *x = ex + E;
        int off = tok_offsets[e], n = tok_offsets[e + 1] - off;
        rc = prepare_expert(codec, mats + (size_t)9 * e, R, I, bits, group, layout, &bad, x->m);
        if (rc || !n) continue;
        x->tok = tok_index + off, x->wt = tok_weight + off, x->n = n;
        atomic_init(&x->gathered, 0), atomic_init(&x->gu_done, 0), atomic_init(&x->d_done, 0);
        nmax = n > nmax ? n : nmax, E++;
    }
    if (!rc && E) {
        pipe_job p = {.ex = ex, .E = E, .R = R, .I = I, .round_model = round_model, .X = X,
                      .acc = acc, .beta = beta, .beta_lin = beta_lin};
        if ((p.out = malloc((size_t)nmax * R * 4))) {
            rc = pipe_run(&p, threads);
            free(p.out);
        } else {
            rc = -2;
        }
    }
    free(ex);
    return rc ? rc : __atomic_load_n(&bad, __ATOMIC_RELAXED) ? -4 : 0;
}
