/* XXH64, the 64-bit xxHash of Yann Collet's published specification, written from that
 * specification: the fast per-record checksum of read-time integrity (offload/digests.py). Four
 * independent multiply-rotate lanes over 32-byte stripes keep the multipliers busy, so one core
 * hashes several GB/s, far above a disk's rate, where SHA-256 runs at about two. Bytes are read
 * as little-endian words; the library builds on little-endian hosts only. */
#include <string.h>

#include "mtplx_cpu.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checksum.c reads little-endian words; this host is not little-endian"
#endif

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t lane_round(uint64_t acc, uint64_t input) {
    return rotl(acc + input * P2, 31) * P1;
}

static inline uint64_t merge_lane(uint64_t h, uint64_t lane) {
    return (h ^ lane_round(0, lane)) * P1 + P4;
}

uint64_t mtplx_cpu_xxh64(const void *data, size_t n, uint64_t seed) {
    const uint8_t *p = data, *end = p + n;
    uint64_t h;
    if (n >= 32) {
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        const uint8_t *last = end - 32;
        do {
            v1 = lane_round(v1, load64(p));
            v2 = lane_round(v2, load64(p + 8));
            v3 = lane_round(v3, load64(p + 16));
            v4 = lane_round(v4, load64(p + 24));
            p += 32;
        } while (p <= last);
        h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
        h = merge_lane(h, v1);
        h = merge_lane(h, v2);
        h = merge_lane(h, v3);
        h = merge_lane(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)n;
    for (; p + 8 <= end; p += 8)
        h = rotl(h ^ lane_round(0, load64(p)), 27) * P1 + P4;
    if (p + 4 <= end) {
        h = rotl(h ^ (uint64_t)load32(p) * P1, 23) * P2 + P3;
        p += 4;
    }
    for (; p < end; p++)
        h = rotl(h ^ (uint64_t)(*p) * P5, 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}
