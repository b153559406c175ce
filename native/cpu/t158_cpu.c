/* t158 CPU kernels: GEMV and the K3 expert MLP computed directly on the packed bytes.
 *
 * Format: FORMAT.md "t158" (spec/t158-and-streaming.md §1, §1.10). Row r of a [rows, cols]
 * projection is G = cols/64 groups of 13 base-3 bytes plus one bf16 scale:
 *   y[r] = Σ_g fp32(scale[r,g]) · Σ_i trit(r,g,i) · x[64g+i],  trit = floor(b/3^k) mod 3 − 1,
 * with bytes 0..11 holding 5 trits and byte 12 holding 4 (its digit 4 is ignored; bytes 243..255
 * decode by the same rule). fp32 accumulation throughout; no dequantized copy is made.
 *
 * Paths (picked at run time with __builtin_cpu_supports, forced lower by t158_set_isa):
 *   0 scalar  : 256x5 float trit table, one row at a time.
 *   1 avx2    : 256x8 float table (5 trits + 3 zeros) times 8 unaligned inputs, FMA per byte.
 *   2 avx512  : the avx2 scheme on two rows at once (one row per 256-bit half of a zmm).
 * Rows are split over pthreads in contiguous chunks. Built by mtplx_runtime/kernels/cpu_build.py.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define GB 13 /* bytes per group */
#define GE 64 /* weights per group */
#define XPAD 16 /* zero floats after x: the SIMD paths read up to 8 past a group's last input */
#define MAX_THREADS 256

static float LUT5[256][5];                        /* trit k of byte b */
static float LUT8[256][8] __attribute__((aligned(32)));   /* digits 0..4, lanes 5..7 zero */
static float LUT8L[256][8] __attribute__((aligned(32)));  /* byte 12: digits 0..3 only */
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;
static int g_isa = -1;

static void init_luts(void) {
    for (int b = 0; b < 256; b++) {
        int v = b;
        for (int k = 0; k < 5; k++, v /= 3) {
            float t = (float)(v % 3 - 1);
            LUT5[b][k] = t;
            LUT8[b][k] = t;
            LUT8L[b][k] = k < 4 ? t : 0.0f;
        }
        for (int k = 5; k < 8; k++) LUT8[b][k] = LUT8L[b][k] = 0.0f;
    }
}

static inline float bf16f(uint16_t u) {
    uint32_t w = (uint32_t)u << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
}

typedef void (*rows_fn)(const uint8_t *, const uint16_t *, int, const float *, float *, int, int);

static void rows_scalar(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y,
                        int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = pk + (size_t)r * G * GB;
        const uint16_t *s = sc + (size_t)r * G;
        float acc = 0.0f;
        for (int g = 0; g < G; g++, p += GB) {
            const float *xg = x + (size_t)g * GE;
            float sum = 0.0f;
            for (int j = 0; j < 12; j++) {
                const float *t = LUT5[p[j]], *xx = xg + 5 * j;
                sum += t[0] * xx[0] + t[1] * xx[1] + t[2] * xx[2] + t[3] * xx[3] + t[4] * xx[4];
            }
            const float *t = LUT5[p[12]], *xx = xg + 60;
            sum += t[0] * xx[0] + t[1] * xx[1] + t[2] * xx[2] + t[3] * xx[3];
            acc += bf16f(s[g]) * sum;
        }
        y[r] = acc;
    }
}

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

__attribute__((target("avx2,fma"))) static void rows_avx2(const uint8_t *pk, const uint16_t *sc,
                                                          int G, const float *x, float *y,
                                                          int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = pk + (size_t)r * G * GB;
        const uint16_t *s = sc + (size_t)r * G;
        __m256 acc = _mm256_setzero_ps();
        for (int g = 0; g < G; g++, p += GB) {
            const float *xg = x + (size_t)g * GE;
            __m256 a0 = _mm256_mul_ps(_mm256_load_ps(LUT8[p[0]]), _mm256_loadu_ps(xg));
            __m256 a1 = _mm256_mul_ps(_mm256_load_ps(LUT8[p[1]]), _mm256_loadu_ps(xg + 5));
            for (int j = 2; j < 12; j += 2) {
                a0 = _mm256_fmadd_ps(_mm256_load_ps(LUT8[p[j]]), _mm256_loadu_ps(xg + 5 * j), a0);
                a1 = _mm256_fmadd_ps(_mm256_load_ps(LUT8[p[j + 1]]),
                                     _mm256_loadu_ps(xg + 5 * j + 5), a1);
            }
            a0 = _mm256_fmadd_ps(_mm256_load_ps(LUT8L[p[12]]), _mm256_loadu_ps(xg + 60), a0);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(bf16f(s[g])), _mm256_add_ps(a0, a1), acc);
        }
        y[r] = hsum256(acc);
    }
}

__attribute__((target("avx512f,avx512dq,avx2,fma"))) static inline __m512
pair(const float *t0, const float *t1) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(t0)), _mm256_load_ps(t1), 1);
}

__attribute__((target("avx512f,avx512dq,avx2,fma"))) static void
rows_avx512(const uint8_t *pk, const uint16_t *sc, int G, const float *x, float *y, int r0,
            int r1) {
    int r = r0;
    size_t stride = (size_t)G * GB;
    for (; r + 1 < r1; r += 2) {
        const uint8_t *p = pk + (size_t)r * stride, *q = p + stride;
        const uint16_t *s = sc + (size_t)r * G, *u = s + G;
        __m512 acc = _mm512_setzero_ps();
        for (int g = 0; g < G; g++, p += GB, q += GB) {
            const float *xg = x + (size_t)g * GE;
            __m512 a0 = _mm512_mul_ps(pair(LUT8[p[0]], LUT8[q[0]]),
                                      _mm512_broadcast_f32x8(_mm256_loadu_ps(xg)));
            __m512 a1 = _mm512_mul_ps(pair(LUT8[p[1]], LUT8[q[1]]),
                                      _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 5)));
            for (int j = 2; j < 12; j += 2) {
                a0 = _mm512_fmadd_ps(pair(LUT8[p[j]], LUT8[q[j]]),
                                     _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 5 * j)), a0);
                a1 = _mm512_fmadd_ps(pair(LUT8[p[j + 1]], LUT8[q[j + 1]]),
                                     _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 5 * j + 5)), a1);
            }
            a0 = _mm512_fmadd_ps(pair(LUT8L[p[12]], LUT8L[q[12]]),
                                 _mm512_broadcast_f32x8(_mm256_loadu_ps(xg + 60)), a0);
            __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(bf16f(s[g])),
                                           _mm256_set1_ps(bf16f(u[g])), 1);
            acc = _mm512_fmadd_ps(sv, _mm512_add_ps(a0, a1), acc);
        }
        y[r] = hsum256(_mm512_castps512_ps256(acc));
        y[r + 1] = hsum256(_mm512_extractf32x8_ps(acc, 1));
    }
    if (r < r1) rows_avx2(pk, sc, G, x, y, r, r1);
}

static rows_fn pick(void) {
    int isa = g_isa;
    return isa >= 2 ? rows_avx512 : isa == 1 ? rows_avx2 : rows_scalar;
}

int t158_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* Select path min(want, best); want < 0 means best. Returns the path now in use. */
int t158_set_isa(int want) {
    int best = t158_best_isa();
    g_isa = (want < 0 || want > best) ? best : want;
    return g_isa;
}

int t158_get_isa(void) {
    if (g_isa < 0) t158_set_isa(-1);
    return g_isa;
}

/* One unit of work: rows [r0, r1) of one matrix. */
typedef struct {
    const uint8_t *pk;
    const uint16_t *sc;
    int G, r0, r1;
    const float *x;
    float *y;
} task_t;

typedef struct {
    rows_fn fn;
    const task_t *tasks;
    int n;
} batch_t;

static void *run_batch(void *arg) {
    const batch_t *b = arg;
    for (int i = 0; i < b->n; i++) {
        const task_t *t = &b->tasks[i];
        if (t->r1 > t->r0) b->fn(t->pk, t->sc, t->G, t->x, t->y, t->r0, t->r1);
    }
    return NULL;
}

/* Run nm matrices (each split into `threads` even-aligned chunks) on `threads` threads. */
static void run_parallel(const task_t *mats, int nm, int rows, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int maxt = (rows + 1) / 2;
    if (threads > maxt) threads = maxt > 0 ? maxt : 1;
    task_t tasks[MAX_THREADS][2];
    batch_t batches[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    rows_fn fn = pick();
    int chunk = (rows + threads - 1) / threads;
    chunk += chunk & 1; /* two-row kernels: keep pairs within one thread */
    for (int t = 0; t < threads; t++) {
        for (int m = 0; m < nm; m++) {
            tasks[t][m] = mats[m];
            tasks[t][m].r0 = t * chunk < rows ? t * chunk : rows;
            tasks[t][m].r1 = (t + 1) * chunk < rows ? (t + 1) * chunk : rows;
        }
        batches[t] = (batch_t){fn, tasks[t], nm};
    }
    int started = 0;
    for (int t = 1; t < threads; t++, started++)
        if (pthread_create(&tid[t], NULL, run_batch, &batches[t])) break;
    for (int t = started + 1; t < threads; t++) run_batch(&batches[t]); /* spawn failed */
    run_batch(&batches[0]);
    for (int t = 1; t <= started; t++) pthread_join(tid[t], NULL);
}

static float *padded(const float *x, int n) {
    float *p = aligned_alloc(64, ((size_t)(n + XPAD) * 4 + 63) / 64 * 64);
    if (!p) return NULL;
    memcpy(p, x, (size_t)n * 4);
    memset(p + n, 0, XPAD * 4);
    return p;
}

/* y[rows] = W x, W = t158 [rows, cols]. Returns 0, or -1 (bad shape) / -2 (out of memory). */
int t158_gemv_f32(const uint8_t *packed, const uint16_t *scales, int rows, int cols,
                  const float *x, float *y, int threads) {
    if (rows < 0 || cols <= 0 || cols % GE) return -1;
    pthread_once(&lut_once, init_luts);
    t158_get_isa();
    float *xp = padded(x, cols);
    if (!xp) return -2;
    task_t m = {packed, scales, cols / GE, 0, rows, xp, y};
    run_parallel(&m, 1, rows, threads);
    free(xp);
    return 0;
}

/* out[R] = down · (SiTU(gate·x) ⊙ β_lin·tanh(up·x / β_lin)); gate/up t158 [I, R], down [R, I].
 * SiTU(g) = β·tanh(g/β)·σ(g), all fp32. Returns 0, -1 (bad shape) or -2 (out of memory). */
int t158_expert_mlp_f32(const uint8_t *gate_packed, const uint16_t *gate_scales,
                        const uint8_t *up_packed, const uint16_t *up_scales,
                        const uint8_t *down_packed, const uint16_t *down_scales, int R, int I,
                        const float *x, float *out, float beta, float beta_lin, int threads) {
    if (R <= 0 || I <= 0 || R % GE || I % GE) return -1;
    pthread_once(&lut_once, init_luts);
    t158_get_isa();
    float *xp = padded(x, R);
    float *gu = malloc((size_t)I * 2 * 4);
    float *h = aligned_alloc(64, ((size_t)(I + XPAD) * 4 + 63) / 64 * 64);
    if (!xp || !gu || !h) {
        free(xp), free(gu), free(h);
        return -2;
    }
    task_t m[2] = {{gate_packed, gate_scales, R / GE, 0, I, xp, gu},
                   {up_packed, up_scales, R / GE, 0, I, xp, gu + I}};
    run_parallel(m, 2, I, threads);
    for (int i = 0; i < I; i++) {
        float g = gu[i], u = gu[I + i];
        float sig = 1.0f / (1.0f + expf(-g));
        h[i] = beta * tanhf(g / beta) * sig * (beta_lin * tanhf(u / beta_lin));
    }
    memset(h + I, 0, XPAD * 4);
    task_t d = {down_packed, down_scales, I / GE, 0, R, h, out};
    run_parallel(&d, 1, R, threads);
    free(xp), free(gu), free(h);
    return 0;
}
