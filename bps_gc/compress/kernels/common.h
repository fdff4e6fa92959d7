/* Shared by the bps_gc codec kernels: every .c file in this folder, linked into one library and
 * called through ctypes from the numpy wrappers one folder up.
 *
 * Pure C, no Python API: the wrappers own every buffer and pass raw pointers. Every decoder
 * validates what it reads (payloads arrive from the network) and returns a negative error code
 * instead of touching memory out of bounds. Built with -ffp-contract=off so that float math
 * rounds exactly like numpy and BytePS (no fused multiply-add).
 *
 * Word layout (codecs.md): bits are packed MSB first into words of W (uint16/32/64), each word
 * stored little-endian.
 */
#ifndef BPS_GC_COMMON_H
#define BPS_GC_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define EXPORT __attribute__((visibility("default")))
#define HOT __attribute__((target_clones("avx2", "default")))

enum { ERR_TRUNCATED = -1, ERR_INDEX = -2, ERR_CODE = -3, ERR_NOMEM = -4, ERR_OVERFLOW = -5, ERR_NONFINITE = -6 };

/* ---------------------------------------------------------------- xorshift128+ */

static inline uint64_t xs_next(uint64_t *s) {
    uint64_t t = s[0];
    const uint64_t u = s[1];
    s[0] = u;
    t ^= t << 23;
    t ^= t >> 17;
    t ^= u ^ (u >> 26);
    s[1] = t;
    return t + u;
}

/* bernoulli(p) = float64(next()) < p * 2^64, as codecs.md says (the dithering draw functions
 * below spell it out per target). */
static inline unsigned xs_bernoulli(uint64_t *s, double p) {
    return (double)xs_next(s) < p * 18446744073709551616.0;
}

/* float64(v), correctly rounded like the cast, without the branch that compilers emit for it
 * before AVX-512 (taken half the time on random bits): hi * 2^32 and lo are exact, so their
 * sum is rounded once. */
static inline double u64_to_double(uint64_t v) {
    return (double)(int64_t)(v >> 32) * 4294967296.0 + (double)(int64_t)(uint32_t)v;
}

/* Streaming loops prefetch this far ahead: the hardware prefetchers alone leave big arrays
 * that sit in L3 (or memory) at a third to a half of the bandwidth software prefetch gets. */
#define PF_AHEAD 8192

/* Prefetch the cache lines of [p, p + bytes) PF_AHEAD bytes ahead (rw: 1 when to be written);
 * prefetches never fault, so running past the end of an array is harmless. */
#define PREFETCH_AHEAD(p, bytes, rw)                                               \
    do {                                                                           \
        for (int pf_ = 0; pf_ < (int)(bytes); pf_ += 64)                           \
            __builtin_prefetch((const char *)(p) + PF_AHEAD + pf_, rw, 3);         \
    } while (0)

#endif
