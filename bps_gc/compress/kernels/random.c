/* xorshift128+ outputs (to check the C generator against the Python one) and randomk. */
#include "common.h"

EXPORT void rng_fill(uint64_t *state, int64_t n, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = xs_next(state);
}

/* v % n, exactly, without a 64-bit division (40+ cycles): the quotient estimated in float64
 * is off by at most 2 when n >= 4096 (v / n < 2^52), and the remainder is then corrected. */
static inline uint64_t mod_u64(uint64_t v, uint64_t n, double inv) {
    if (n < 4096) return v % n;
    int64_t q = (int64_t)(u64_to_double(v) * inv);
    int64_t r = (int64_t)(v - (uint64_t)q * n);
    while (r < 0) r += (int64_t)n;
    while (r >= (int64_t)n) r -= (int64_t)n;
    return (uint64_t)r;
}

/* randomk: k draws of randint(0, n) with replacement, in draw order. */
EXPORT void randomk_indices(uint64_t *state, int64_t n, int64_t k, uint32_t *idx) {
    uint64_t st[2] = {state[0], state[1]};
    double inv = 1.0 / (double)n;
    for (int64_t i = 0; i < k; i++) idx[i] = (uint32_t)mod_u64(xs_next(st), (uint64_t)n, inv);
    state[0] = st[0];
    state[1] = st[1];
}

/* randomk's payload in one call: k records (index, x[index]) for the same draws. The draws
 * of a chunk come first, then its loads, which are then independent of one another and of the
 * generator's chain, and were prefetched while drawing, so the cache misses overlap. */
#define DEFINE_RANDOMK_RECORDS(T, IT, SUFFIX)                                     \
    typedef struct __attribute__((packed)) { IT idx; T val; } rrec_##SUFFIX;      \
    EXPORT void randomk_records_##SUFFIX(uint64_t *state, const T *x, int64_t n, int64_t k, rrec_##SUFFIX *rec) { \
        uint64_t st[2] = {state[0], state[1]};                                    \
        double inv = 1.0 / (double)n;                                             \
        uint32_t j[256];                                                          \
        for (int64_t c = 0; c < k; c += 256) {                                    \
            int m = k - c < 256 ? (int)(k - c) : 256;                             \
            for (int i = 0; i < m; i++) {                                         \
                j[i] = (uint32_t)mod_u64(xs_next(st), (uint64_t)n, inv);          \
                __builtin_prefetch(x + j[i], 0, 3);                               \
            }                                                                     \
            for (int i = 0; i < m; i++) {                                         \
                rec[c + i].idx = (IT)j[i];                                        \
                rec[c + i].val = x[j[i]];                                         \
            }                                                                     \
        }                                                                         \
        state[0] = st[0];                                                         \
        state[1] = st[1];                                                         \
    }
DEFINE_RANDOMK_RECORDS(float, uint32_t, f32)
DEFINE_RANDOMK_RECORDS(double, uint64_t, f64)
