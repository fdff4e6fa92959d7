/* xorshift128+ outputs (to check the C generator against the Python one) and randomk. */
#include "common.h"

EXPORT void rng_fill(uint64_t *state, int64_t n, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = xs_next(state);
}

/* randomk: k draws of randint(0, n) with replacement, in draw order. */
EXPORT void randomk_indices(uint64_t *state, int64_t n, int64_t k, uint32_t *idx) {
    for (int64_t i = 0; i < k; i++) idx[i] = (uint32_t)(xs_next(state) % (uint64_t)n);
}

