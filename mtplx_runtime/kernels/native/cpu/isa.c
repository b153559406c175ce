/* The ISA switch of the CPU expert library (mtplx_cpu.h): one portable build whose SIMD variants
 * sit behind per-function target attributes, and one choice of path, read by every codec, the
 * SiTU-GLU loop (glu.c) and the record checksum (checksum.c) alike. */
#include "cpu_common.h"

/* The path in use (0 scalar, 1 avx2, 2 avx512, 3 avx512bf16); -1 until first asked or set. */
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

int cpu_has_avx512bw(void) {
    static int ok = -1;
    if (ok < 0) {
        __builtin_cpu_init();
        ok = __builtin_cpu_supports("avx512bw");
    }
    return ok;
}
