/* A/B timing of CPU kernel libraries in one process: each library given (a built mtplx_cpu .so,
 * for example the current one and one built from an older commit's sources) runs the same K3
 * layer through mtplx_cpu_layer, in interleaved rounds, and the best time of each is printed
 * with the sum of |output| (equal sums: same work; bit-level checks are the tests' job).
 *
 *   gcc -O2 tools/kernel_lab/ab_layer.c -o /tmp/ab_layer -ldl -lm
 *   /tmp/ab_layer CODEC T ROUNDS HUGE LIB.so [LIB.so ...]
 *
 * CODEC: t158, mxfp4, ct3 or ct4 (ct-int dense, symmetric). T tokens, each routed to all
 * experts. HUGE 1: the records get madvise(MADV_HUGEPAGE), as offload/buffers.py asks for the
 * runtime's slots; 0: MADV_NOHUGEPAGE. Environment: TH threads (default 2), E experts (default
 * 16; 1 keeps one expert in L3), CPUT=1 times process CPU time instead of wall time: on a busy
 * machine that counts only the time the kernel threads ran (best with TH=1, since with 2
 * threads a spinning pool thread's CPU time counts too). BF16=1 runs a bf16 model as the
 * runtime does: inputs rounded to bf16 values and round_model = 1 (so the down projection's
 * inputs are bf16 values too); the default is fp32 inputs, round_model = 0.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef int (*layer_fn)(int, const void *const *, int, const int *, const int *, const float *,
                        int, int, int, int, const float *, int, float *, float, float, int, int);

static clockid_t clk = CLOCK_MONOTONIC;

static double now(void) {
    struct timespec t;
    clock_gettime(clk, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) { /* xorshift64 */
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return rng_state;
}

static void *map(size_t n, int huge) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return p;
}

static int env_int(const char *name, int dflt) {
    const char *v = getenv(name);
    return v ? atoi(v) : dflt;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s CODEC T ROUNDS HUGE LIB.so [LIB.so ...]\n", argv[0]);
        return 2;
    }
    const char *c = argv[1];
    int T = atoi(argv[2]), rounds = atoi(argv[3]), huge = atoi(argv[4]), nlib = argc - 5;
    int threads = env_int("TH", 2), E = env_int("E", 16), R = 3584, I = 3072, codec, bits = 0;
    if (env_int("CPUT", 0)) clk = CLOCK_PROCESS_CPUTIME_ID;
    int bf16 = env_int("BF16", 0);
    if (!strcmp(c, "t158")) codec = 0;
    else if (!strcmp(c, "mxfp4")) codec = 1;
    else if (!strcmp(c, "ct3") || !strcmp(c, "ct4")) codec = 2, bits = c[2] - '0';
    else {
        fprintf(stderr, "unknown codec %s\n", c);
        return 2;
    }
    /* gate, up [I, R] and down [R, I] of every expert, packed bytes then scales */
    const void **mats = calloc((size_t)9 * E, sizeof *mats);
    size_t total = 0;
    for (int e = 0; e < E; e++)
        for (int k = 0; k < 3; k++) {
            size_t rows = k < 2 ? I : R, cols = k < 2 ? R : I, pb, sb;
            if (codec == 0) pb = cols / 64 * 13, sb = cols / 64 * 2;
            else if (codec == 1) pb = cols / 2, sb = cols / 32;
            else pb = cols * bits / 8, sb = cols / 64 * 2;
            pb *= rows, sb *= rows;
            uint8_t *p = map(pb + sb, huge), *s = p + pb;
            for (size_t i = 0; i < pb; i++) p[i] = (uint8_t)rnd(); /* every code value */
            if (codec == 1) /* E8M0 around 2^-7 */
                for (size_t i = 0; i < sb; i++) s[i] = (uint8_t)(115 + rnd() % 10);
            else /* bf16 0.01 */
                for (size_t i = 0; i < sb / 2; i++) ((uint16_t *)s)[i] = 0x3C23;
            mats[9 * e + 3 * k] = p, mats[9 * e + 3 * k + 1] = s;
            total += pb + sb;
        }
    int *off = malloc((E + 1) * sizeof *off), *idx = malloc((size_t)E * T * sizeof *idx);
    float *wt = malloc((size_t)E * T * sizeof *wt);
    for (int e = 0; e <= E; e++) off[e] = e * T;
    for (int j = 0; j < E * T; j++) idx[j] = j % T, wt[j] = 1.0f / E;
    float *X = malloc((size_t)T * R * 4), *acc = malloc((size_t)T * R * 4);
    for (int i = 0; i < T * R; i++) {
        X[i] = ((int)(rnd() % 2000) - 1000) / 1000.0f;
        if (bf16) { /* nearest-even bf16 */
            uint32_t u;
            memcpy(&u, &X[i], 4);
            u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
            memcpy(&X[i], &u, 4);
        }
    }
    layer_fn fn[16];
    if (nlib > 16) nlib = 16;
    for (int l = 0; l < nlib; l++) {
        void *h = dlopen(argv[5 + l], RTLD_NOW | RTLD_LOCAL);
        if (!h || !(fn[l] = (layer_fn)dlsym(h, "mtplx_cpu_layer"))) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
    }
    size_t nb = (size_t)1 << 30; /* copy bandwidth, read + write bytes, as bench_kernels */
    char *a = map(nb, 0), *b = map(nb, 0);
    memset(a, 1, nb), memset(b, 0, nb);
    double copy = 1e30;
    for (int i = 0; i < 4; i++) {
        double t0 = now();
        memcpy(b, a, nb);
        double d = now() - t0;
        copy = d < copy ? d : copy;
    }
    munmap(a, nb), munmap(b, nb);
    double best[16], sum[16];
    for (int l = 0; l < nlib; l++) best[l] = 1e30;
    for (int r = 0; r < rounds; r++)
        for (int l = 0; l < nlib; l++) {
            for (int rep = 0; rep < 3; rep++) {
                memset(acc, 0, (size_t)T * R * 4);
                /* past the pool's spin window (200 us), so the previous library's workers have
                 * gone to sleep and do not take a CPU from this one's */
                nanosleep(&(struct timespec){0, 2000000}, NULL);
                double t0 = now();
                int rc = fn[l](codec, mats, E, off, idx, wt, R, I, bits, 0, X, T, acc, 4.0f,
                               25.0f, bf16, threads);
                double d = now() - t0;
                if (rc) {
                    fprintf(stderr, "%s: mtplx_cpu_layer returned %d\n", argv[5 + l], rc);
                    return 1;
                }
                best[l] = d < best[l] ? d : best[l];
            }
            sum[l] = 0;
            for (int i = 0; i < T * R; i++) sum[l] += fabs(acc[i]);
        }
    printf("%s T=%d experts=%d threads=%d huge=%d clock=%s inputs=%s: layer %.1f MB, memcpy "
           "%.2f GB/s\n", c, T, E, threads, huge, clk == CLOCK_MONOTONIC ? "wall" : "cpu",
           bf16 ? "bf16" : "fp32", total / 1e6, 2.0 * nb / copy / 1e9);
    for (int l = 0; l < nlib; l++)
        printf("  %8.2f ms/layer %6.2f GB/s %5.1f%% of copy  sum|out| %.6g  %s\n", best[l] * 1e3,
               total / best[l] / 1e9, 100 * total / best[l] / (2.0 * nb / copy), sum[l],
               argv[5 + l]);
    return 0;
}
