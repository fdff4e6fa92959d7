#include "common.h"

/* ---------------------------------------------------------------- top-k selection */

/* A candidate is ranked by (|x| bits descending, index ascending): the abs bit pattern of an
 * IEEE float orders like its value, so ties go to the lower index exactly as codecs.md says. */
typedef struct {
    uint64_t key;
    uint32_t idx;
} cand_t;

static inline int cand_better(const cand_t *a, const cand_t *b) {
    return a->key > b->key || (a->key == b->key && a->idx < b->idx);
}

/* Reorder c[0..m) so that its best k come first (quickselect, median of three). */
static void select_best(cand_t *c, int64_t m, int64_t k) {
    int64_t lo = 0, hi = m - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (cand_better(&c[mid], &c[lo])) { cand_t t = c[mid]; c[mid] = c[lo]; c[lo] = t; }
        if (cand_better(&c[hi], &c[lo])) { cand_t t = c[hi]; c[hi] = c[lo]; c[lo] = t; }
        if (cand_better(&c[hi], &c[mid])) { cand_t t = c[hi]; c[hi] = c[mid]; c[mid] = t; }
        cand_t pivot = c[mid];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (cand_better(&c[i], &pivot)) i++;
            while (cand_better(&pivot, &c[j])) j--;
            if (i <= j) { cand_t t = c[i]; c[i] = c[j]; c[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* Collect every element whose key is >= threshold; stop (returning -1) past cap. */
#define DEFINE_COLLECT(T, UT, MASK, SUFFIX)                                       \
    static HOT int64_t collect_##SUFFIX(const T *x, int64_t n, uint64_t thr, cand_t *c, int64_t cap) { \
        const UT *u = (const UT *)x;                                              \
        int64_t m = 0;                                                            \
        for (int64_t i = 0; i < n; i++) {                                         \
            uint64_t key = (uint64_t)(u[i] & MASK);                               \
            if (key >= thr) {                                                     \
                if (m == cap) return -1;                                          \
                c[m].key = key;                                                   \
                c[m].idx = (uint32_t)i;                                           \
                m++;                                                              \
            }                                                                     \
        }                                                                         \
        return m;                                                                 \
    }

/* topk_indices: write the indices of the k largest |x| (any order) into idx.
 * A strided sample estimates a threshold a little below the k-th largest key; one pass collects
 * the elements above it and an exact selection runs on those few. If the estimate lets fewer
 * than k (or far too many) through, the threshold is relaxed (or the whole array is used). */
#define DEFINE_TOPK(T, UT, MASK, SUFFIX)                                          \
    DEFINE_COLLECT(T, UT, MASK, SUFFIX)                                           \
    EXPORT int64_t topk_indices_##SUFFIX(const T *x, int64_t n, int64_t k, uint32_t *idx) { \
        const UT *u = (const UT *)x;                                              \
        cand_t *c = NULL;                                                         \
        int64_t m = -1;                                                           \
        if (k * 16 < n) {                                                         \
            int64_t s = 32 * n / k; /* ~32 sample hits expected above the k-th key */ \
            if (s > n / 4) s = n / 4;                                             \
            int64_t stride = n / s;                                               \
            cand_t *smp = malloc(sizeof(cand_t) * s);                             \
            if (!smp) return ERR_NOMEM;                                           \
            for (int64_t i = 0; i < s; i++) {                                     \
                smp[i].key = (uint64_t)(u[i * stride] & MASK);                    \
                smp[i].idx = (uint32_t)i;                                         \
            }                                                                     \
            int64_t cap = 6 * k + 1024;                                           \
            c = malloc(sizeof(cand_t) * cap);                                     \
            if (!c) { free(smp); return ERR_NOMEM; }                              \
            /* rank in the sample: twice the expected hits plus slack, then wider */ \
            for (int64_t r = 2 * (k * s / n) + 16; r < s && m < k; r *= 4) {      \
                select_best(smp, s, r);                                           \
                uint64_t thr = smp[r - 1].key;                                    \
                if (thr == 0) { m = -1; break; } /* mostly zeros: see below */    \
                m = collect_##SUFFIX(x, n, thr, c, cap);                          \
                if (m < 0) break; /* threshold too low for the buffer: use all */ \
            }                                                                     \
            free(smp);                                                            \
            if (m < k) { free(c); c = NULL; m = -1; }                             \
        }                                                                         \
        if (m < 0) {                                                              \
            /* every nonzero, then (a sparse input, e.g. a server's sum of top-k \
             * pushes) the zeros of lowest index, which win the ties among zeros */ \
            c = malloc(sizeof(cand_t) * (n ? n : 1));                             \
            if (!c) return ERR_NOMEM;                                             \
            m = collect_##SUFFIX(x, n, 1, c, n);                                  \
            for (int64_t i = 0; m < k && i < n; i++)                              \
                if ((u[i] & MASK) == 0) { c[m].key = 0; c[m].idx = (uint32_t)i; m++; } \
        }                                                                         \
        select_best(c, m, k);                                                     \
        for (int64_t i = 0; i < k; i++) idx[i] = c[i].idx;                        \
        free(c);                                                                  \
        return k;                                                                 \
    }
DEFINE_TOPK(float, uint32_t, 0x7fffffffu, f32)
DEFINE_TOPK(double, uint64_t, 0x7fffffffffffffffull, f64)

