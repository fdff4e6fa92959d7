#include "common.h"

/* ---------------------------------------------------------------- sparse records */

/* topk/randomk payload: k records of (IT index, T value), packed. */
#define DEFINE_RECORDS(T, IT, SUFFIX)                                             \
    typedef struct __attribute__((packed)) { IT idx; T val; } rec_##SUFFIX;       \
    EXPORT void records_gather_##SUFFIX(const T *x, const uint32_t *idx, int64_t k, rec_##SUFFIX *rec) { \
        for (int64_t i = 0; i < k; i++) { rec[i].idx = idx[i]; rec[i].val = x[idx[i]]; } \
    }                                                                             \
    /* y = 0; y[index] = value. Every index is checked before anything is written. */ \
    EXPORT int64_t records_scatter_##SUFFIX(const rec_##SUFFIX *rec, int64_t k, int64_t n, T *y) { \
        for (int64_t i = 0; i < k; i++)                                           \
            if (rec[i].idx >= (uint64_t)n) return ERR_INDEX;                      \
        memset(y, 0, sizeof(T) * n);                                              \
        for (int64_t i = 0; i < k; i++) y[rec[i].idx] = rec[i].val;               \
        return 0;                                                                 \
    }
DEFINE_RECORDS(float, uint32_t, f32)
DEFINE_RECORDS(double, uint64_t, f64)

