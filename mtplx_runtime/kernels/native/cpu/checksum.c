/* XXH3-64 with a 64-bit seed (xxHash's XXH3_64bits_withSeed; seed 0 is plain XXH3_64bits), the
 * 64-bit XXH3 of Yann Collet's published xxHash specification, written from that specification:
 * the fast per-record checksum of read-time integrity (offload/digests.py, which seeds it with a
 * per-user secret). Inputs over 240 bytes (every record) run through eight 64-bit accumulators
 * fed 64-byte stripes with one 32x32->64 multiply per lane, which maps onto one AVX-512 register
 * or two AVX2 ones; the path follows the library's ISA switch (isa.c), with a scalar twin of
 * each. A seed enters the short paths as published and the long one through a secret derived
 * from it (seeded_secret). Bytes are read as little-endian words; the library builds on
 * little-endian hosts only. */
#include "cpu_common.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checksum.c reads little-endian words; this host is not little-endian"
#endif

#define P32_1 0x9E3779B1ULL
#define P32_2 0x85EBCA77ULL
#define P32_3 0xC2B2AE3DULL
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX_1 0x165667919E3779F9ULL
#define PMX_2 0x9FB21C651E98DF25ULL

#define SECRET_BYTES 192
#define STRIPE 64
#define STRIPES_PER_BLOCK ((SECRET_BYTES - STRIPE) / 8) /* 16: a block is 1 KiB */
#define BLOCK_BYTES (STRIPE * STRIPES_PER_BLOCK)
#define SCRAMBLE_AT (SECRET_BYTES - STRIPE)
#define LAST_STRIPE_AT (SECRET_BYTES - STRIPE - 7)

static const uint8_t SECRET[SECRET_BYTES] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* The full 64x64 -> 128-bit product, its halves xor-ed together. */
static inline uint64_t mul_fold(uint64_t a, uint64_t b) {
    unsigned __int128 m = (unsigned __int128)a * b;
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

static inline uint64_t avalanche(uint64_t x) {
    x ^= x >> 37;
    x *= PMX_1;
    return x ^ (x >> 32);
}

static inline uint64_t avalanche_xxh64(uint64_t x) {
    x ^= x >> 33;
    x *= P64_2;
    x ^= x >> 29;
    x *= P64_3;
    return x ^ (x >> 32);
}

/* 16 bytes of input against 16 of the secret, the secret's low word plus the seed and its
 * high word minus it: the step of 17..240-byte inputs. */
static inline uint64_t mix16(const uint8_t *p, const uint8_t *s, uint64_t seed) {
    return mul_fold(rd64(p) ^ (rd64(s) + seed), rd64(p + 8) ^ (rd64(s + 8) - seed));
}

static uint64_t hash_0to16(const uint8_t *p, size_t n, uint64_t seed) {
    if (n > 8) {
        uint64_t lo = ((rd64(SECRET + 24) ^ rd64(SECRET + 32)) + seed) ^ rd64(p);
        uint64_t hi = ((rd64(SECRET + 40) ^ rd64(SECRET + 48)) - seed) ^ rd64(p + n - 8);
        return avalanche(n + __builtin_bswap64(lo) + hi + mul_fold(lo, hi));
    }
    if (n >= 4) {
        seed ^= (uint64_t)__builtin_bswap32((uint32_t)seed) << 32; /* the published mixing */
        uint64_t v = ((rd64(SECRET + 8) ^ rd64(SECRET + 16)) - seed)
                     ^ ((uint64_t)rd32(p + n - 4) | (uint64_t)rd32(p) << 32);
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PMX_2;
        v ^= (v >> 35) + n;
        v *= PMX_2;
        return v ^ (v >> 28);
    }
    if (n) {
        uint32_t c = (uint32_t)p[n - 1] | (uint32_t)n << 8 | (uint32_t)p[0] << 16
                     | (uint32_t)p[n >> 1] << 24;
        return avalanche_xxh64(((uint64_t)(rd32(SECRET) ^ rd32(SECRET + 4)) + seed) ^ c);
    }
    return avalanche_xxh64(seed ^ rd64(SECRET + 56) ^ rd64(SECRET + 64));
}

static uint64_t hash_17to240(const uint8_t *p, size_t n, uint64_t seed) {
    uint64_t acc = n * P64_1;
    if (n <= 128) {
        for (size_t i = 0; i < ((n - 1) >> 5) + 1; i++) {
            acc += mix16(p + 16 * i, SECRET + 32 * i, seed);
            acc += mix16(p + n - 16 * i - 16, SECRET + 32 * i + 16, seed);
        }
        return avalanche(acc);
    }
    for (size_t i = 0; i < 8; i++) acc += mix16(p + 16 * i, SECRET + 16 * i, seed);
    acc = avalanche(acc);
    for (size_t i = 8; i < n >> 4; i++)
        acc += mix16(p + 16 * i, SECRET + 16 * (i - 8) + 3, seed);
    acc += mix16(p + n - 16, SECRET + 119, seed);
    return avalanche(acc);
}

/* ---- inputs over 240 bytes: accumulate stripes, scramble after every block ----
 * Each path runs the whole stripe loop with the accumulators in registers: blocks before the
 * last are accumulated and scrambled; the last one (1..1024 bytes) runs its stripes but the
 * final one, then the input's last 64 bytes are one more stripe at secret offset 121. Every
 * step reads `s`, the default secret for seed 0, else the one seeded_secret derives. */

static inline void stripe_scalar(uint64_t *acc, const uint8_t *p, const uint8_t *s) {
    for (int i = 0; i < 8; i++) {
        uint64_t d = rd64(p + 8 * i), v = d ^ rd64(s + 8 * i);
        acc[i ^ 1] += d;
        acc[i] += (v & 0xFFFFFFFFu) * (v >> 32);
    }
}

static void long_scalar(uint64_t *acc, const uint8_t *p, size_t n, const uint8_t *s) {
    size_t blocks = (n - 1) / BLOCK_BYTES, tail = (n - blocks * BLOCK_BYTES - 1) / STRIPE;
    const uint8_t *q = p;
    for (size_t b = 0; b < blocks; b++, q += BLOCK_BYTES) {
        for (int k = 0; k < STRIPES_PER_BLOCK; k++)
            stripe_scalar(acc, q + STRIPE * k, s + 8 * k);
        for (int i = 0; i < 8; i++)
            acc[i] = (acc[i] ^ (acc[i] >> 47) ^ rd64(s + SCRAMBLE_AT + 8 * i)) * P32_1;
    }
    for (size_t k = 0; k < tail; k++) stripe_scalar(acc, q + STRIPE * k, s + 8 * k);
    stripe_scalar(acc, p + n - STRIPE, s + LAST_STRIPE_AT);
}

/* A lane adds lo32(v) * hi32(v), v = input ^ secret, and its neighbour's input (the two 64-bit
 * halves of every 128-bit lane swapped: shuffle 0x4E). */
__attribute__((target("avx2"))) static inline __m256i stripe_avx2(__m256i a, const uint8_t *p,
                                                                  const uint8_t *s) {
    __m256i d = _mm256_loadu_si256((const __m256i *)p);
    __m256i v = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)s));
    __m256i m = _mm256_mul_epu32(v, _mm256_srli_epi64(v, 32));
    return _mm256_add_epi64(a, _mm256_add_epi64(m, _mm256_shuffle_epi32(d, 0x4E)));
}

/* (a ^ a >> 47 ^ s) * P32_1 mod 2^64 from two 32x32 products: lo*P + (hi*P << 32). */
__attribute__((target("avx2"))) static inline __m256i scramble_avx2(__m256i a, const uint8_t *s) {
    const __m256i prime = _mm256_set1_epi64x(P32_1);
    a = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)),
                         _mm256_loadu_si256((const __m256i *)s));
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
    return _mm256_add_epi64(_mm256_mul_epu32(a, prime), _mm256_slli_epi64(hi, 32));
}

__attribute__((target("avx2"))) static void long_avx2(uint64_t *acc, const uint8_t *p, size_t n,
                                                      const uint8_t *s) {
    size_t blocks = (n - 1) / BLOCK_BYTES, tail = (n - blocks * BLOCK_BYTES - 1) / STRIPE;
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const uint8_t *q = p;
    for (size_t b = 0; b < blocks; b++, q += BLOCK_BYTES) {
        for (int k = 0; k < STRIPES_PER_BLOCK; k++) {
            a0 = stripe_avx2(a0, q + STRIPE * k, s + 8 * k);
            a1 = stripe_avx2(a1, q + STRIPE * k + 32, s + 8 * k + 32);
        }
        a0 = scramble_avx2(a0, s + SCRAMBLE_AT);
        a1 = scramble_avx2(a1, s + SCRAMBLE_AT + 32);
    }
    for (size_t k = 0; k < tail; k++) {
        a0 = stripe_avx2(a0, q + STRIPE * k, s + 8 * k);
        a1 = stripe_avx2(a1, q + STRIPE * k + 32, s + 8 * k + 32);
    }
    a0 = stripe_avx2(a0, p + n - STRIPE, s + LAST_STRIPE_AT);
    a1 = stripe_avx2(a1, p + n - STRIPE + 32, s + LAST_STRIPE_AT + 32);
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

__attribute__((target(AVX512_TARGET))) static inline __m512i stripe_avx512(__m512i a,
                                                                           const uint8_t *p,
                                                                           const uint8_t *s) {
    __m512i d = _mm512_loadu_si512(p);
    __m512i v = _mm512_xor_si512(d, _mm512_loadu_si512(s));
    __m512i m = _mm512_mul_epu32(v, _mm512_srli_epi64(v, 32));
    return _mm512_add_epi64(a, _mm512_add_epi64(m, _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)0x4E)));
}

__attribute__((target(AVX512_TARGET))) static void long_avx512(uint64_t *acc, const uint8_t *p,
                                                               size_t n, const uint8_t *s) {
    const __m512i prime = _mm512_set1_epi64(P32_1);
    const __m512i key = _mm512_loadu_si512(s + SCRAMBLE_AT);
    size_t blocks = (n - 1) / BLOCK_BYTES, tail = (n - blocks * BLOCK_BYTES - 1) / STRIPE;
    __m512i a = _mm512_loadu_si512(acc);
    const uint8_t *q = p;
    for (size_t b = 0; b < blocks; b++, q += BLOCK_BYTES) {
        for (int k = 0; k < STRIPES_PER_BLOCK; k++)
            a = stripe_avx512(a, q + STRIPE * k, s + 8 * k);
        a = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)), key);
        __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
        a = _mm512_add_epi64(_mm512_mul_epu32(a, prime), _mm512_slli_epi64(hi, 32));
    }
    for (size_t k = 0; k < tail; k++) a = stripe_avx512(a, q + STRIPE * k, s + 8 * k);
    a = stripe_avx512(a, p + n - STRIPE, s + LAST_STRIPE_AT);
    _mm512_storeu_si512(acc, a);
}

/* xxHash's XXH3_initCustomSecret: each 16 bytes of the default secret as two little-endian
 * words, the low one plus the seed and the high one minus it (mod 2^64); seed 0 gives the
 * default secret back. */
static void seeded_secret(uint8_t *out, uint64_t seed) {
    for (int i = 0; i < SECRET_BYTES; i += 16) {
        uint64_t lo = rd64(SECRET + i) + seed, hi = rd64(SECRET + i + 8) - seed;
        memcpy(out + i, &lo, 8);
        memcpy(out + i + 8, &hi, 8);
    }
}

static uint64_t hash_long(const uint8_t *p, size_t n, const uint8_t *s, int isa) {
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    if (isa >= 2)
        long_avx512(acc, p, n, s);
    else if (isa == 1)
        long_avx2(acc, p, n, s);
    else
        long_scalar(acc, p, n, s);
    uint64_t h = n * P64_1;
    for (int i = 0; i < 4; i++)
        h += mul_fold(acc[2 * i] ^ rd64(s + 11 + 16 * i), acc[2 * i + 1] ^ rd64(s + 19 + 16 * i));
    return avalanche(h);
}

uint64_t mtplx_cpu_xxh3_64(const void *data, size_t n, uint64_t seed) {
    const uint8_t *p = data;
    if (n <= 16) return hash_0to16(p, n, seed);
    if (n <= 240) return hash_17to240(p, n, seed);
    /* Seed 0 derives the default secret, so one path serves both; reading the secret from the
     * stack rather than as constants measured no slower (tools/bench_checksum.py). */
    uint8_t custom[SECRET_BYTES] __attribute__((aligned(64)));
    seeded_secret(custom, seed);
    return hash_long(p, n, custom, mtplx_cpu_get_isa());
}
