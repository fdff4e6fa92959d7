/* The scans and fused updates that the sparse codecs, DGC, PowerSGD and error feedback share
 * (docs/codecs.md): |x| keys, threshold collection, finiteness, momentum correction, sorted
 * records and the low-rank product. */
#include "common.h"

/* ---------------------------------------------------------------- scans */

/* max of |x| as IEEE bits (NaN sorts above inf, so a NaN anywhere is the answer). */
#define DEFINE_KEYMAX(UT, MASK, SUFFIX)                                           \
    EXPORT HOT uint64_t key_max_##SUFFIX(const UT *u, int64_t n) {                \
        UT m = 0;                                                                 \
        for (int64_t i = 0; i < n; i++) { UT k = u[i] & MASK; m = k > m ? k : m; } \
        return m;                                                                 \
    }
DEFINE_KEYMAX(uint32_t, 0x7fffffffu, u32)
DEFINE_KEYMAX(uint16_t, 0x7fffu, u16)

/* Indices (ascending) of the elements whose |x| bits are >= thr: returns how many there are,
 * writing only the first cap of them. */
#define DEFINE_COLLECT_IDX(UT, MASK, SUFFIX)                                      \
    static int64_t key_collect_tail_##SUFFIX(const UT *u, int64_t from, int64_t n, uint64_t thr, \
                                              uint32_t *idx, int64_t cap, int64_t m) { \
        for (int64_t i = from; i < n; i++) {                                      \
            if ((uint64_t)(u[i] & MASK) >= thr) {                                 \
                if (m < cap) idx[m] = (uint32_t)i;                                \
                m++;                                                              \
            }                                                                     \
        }                                                                         \
        return m;                                                                 \
    }
DEFINE_COLLECT_IDX(uint32_t, 0x7fffffffu, u32)
DEFINE_COLLECT_IDX(uint16_t, 0x7fffu, u16)

/* AVX2: eight keys per compare; blocks of 32 with no hit (almost all of them) cost four
 * compares and one test. Keys and thresholds are below 2^31, so signed compares order them. */
__attribute__((target("avx2"))) static int64_t key_collect_avx2_u32(const uint32_t *u, int64_t n, uint64_t thr,
                                                                    uint32_t *idx, int64_t cap) {
    const __m256i mask = _mm256_set1_epi32(0x7fffffff), lim = _mm256_set1_epi32((int32_t)(thr - 1));
    int64_t m = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        PREFETCH_AHEAD(u + i, 128, 0);
        uint32_t bits = 0;
        for (int b = 0; b < 4; b++) {
            __m256i k = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(u + i + 8 * b)), mask);
            bits |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, lim))) << (8 * b);
        }
        while (bits) {
            int t = __builtin_ctz(bits);
            bits &= bits - 1;
            if (m < cap) idx[m] = (uint32_t)(i + t);
            m++;
        }
    }
    return key_collect_tail_u32(u, i, n, thr, idx, cap, m);
}

EXPORT int64_t key_collect_u32(const uint32_t *u, int64_t n, uint64_t thr, uint32_t *idx, int64_t cap) {
    if (thr >= 1 && thr <= 0x80000000ull && __builtin_cpu_supports("avx2"))
        return key_collect_avx2_u32(u, n, thr, idx, cap);
    return key_collect_tail_u32(u, 0, n, thr, idx, cap, 0);
}
EXPORT int64_t key_collect_u16(const uint16_t *u, int64_t n, uint64_t thr, uint32_t *idx, int64_t cap) {
    return key_collect_tail_u16(u, 0, n, thr, idx, cap, 0);
}

/* 1 when every element is finite (exponent bits not all ones). */
#define DEFINE_FINITE(UT, EXP, SUFFIX)                                            \
    EXPORT HOT int all_finite_##SUFFIX(const UT *u, int64_t n) {                  \
        UT bad = 0;                                                               \
        for (int64_t i = 0; i < n; i++) bad |= (UT)((u[i] & EXP) == EXP);         \
        return !bad;                                                              \
    }
DEFINE_FINITE(uint32_t, 0x7f800000u, u32)
DEFINE_FINITE(uint16_t, 0x7c00u, u16)
DEFINE_FINITE(uint64_t, 0x7ff0000000000000ull, u64)

/* out = a * s + x, rounded twice like numpy's multiply then add; returns 1 when every result
 * is finite (error feedback and momentum keep their state only then). */
#define DEFINE_SCALE_ADD(T, SUFFIX)                                               \
    EXPORT HOT int scale_add_##SUFFIX(const T *a, T s, const T *x, int64_t n, T *out) { \
        int ok = 1;                                                               \
        for (int64_t i = 0; i < n; i++) {                                         \
            T t = a[i] * s;                                                       \
            t = t + x[i];                                                         \
            out[i] = t;                                                           \
            ok &= (t - t) == 0; /* false for inf and NaN */                       \
        }                                                                         \
        return ok;                                                                \
    }
DEFINE_SCALE_ADD(float, f32)
DEFINE_SCALE_ADD(double, f64)

/* ---------------------------------------------------------------- DGC momentum correction */

/* plain: u = mu*u + g; v += u.  nesterov: u = mu*(u + g); v += u + g. */
EXPORT HOT void dgc_accumulate_f32(const float *g, float *u, float *v, int64_t n, float mu, int nesterov) {
    if (nesterov)
        for (int64_t i = 0; i < n; i++) {
            float t = (u[i] + g[i]) * mu;
            u[i] = t;
            v[i] = v[i] + t + g[i];
        }
    else
        for (int64_t i = 0; i < n; i++) {
            float t = u[i] * mu + g[i];
            u[i] = t;
            v[i] = v[i] + t;
        }
}

/* ---------------------------------------------------------------- sorted sparse records */

/* (uint32 index, float32 value) records with strictly increasing indices < n:
 * zero_first ? y = scatter : y += scatter. Everything is checked before anything is written.
 * With many records (more than one per 64 elements) decoding zero-fills the output in L1-sized
 * blocks and writes each block's records right after, so every cache line of y is written
 * once; with few, one memset (glibc's big-buffer path is faster than blocks) and a scatter. */
#define ZBLOCK 4096
EXPORT HOT int64_t sorted_records_add_f32(const uint8_t *rec, int64_t k, int64_t n, float *y, int zero_first) {
    int64_t prev = -1;
    for (int64_t i = 0; i < k; i++) {
        uint32_t idx;
        memcpy(&idx, rec + 8 * i, 4);
        if ((int64_t)idx <= prev || (int64_t)idx >= n) return ERR_INDEX;
        prev = idx;
    }
    int64_t r = 0, block = k * 64 > n ? ZBLOCK : n;
    for (int64_t start = 0; start < n; start += block) {
        int64_t stop = start + block < n ? start + block : n;
        if (zero_first) memset(y + start, 0, sizeof(float) * (size_t)(stop - start));
        for (; r < k; r++) {
            uint32_t idx;
            float v;
            memcpy(&idx, rec + 8 * r, 4);
            if (idx >= stop) break;
            memcpy(&v, rec + 8 * r + 4, 4);
            y[idx] = zero_first ? v : y[idx] + v; /* = keeps a -0.0 value's sign */
        }
    }
    return 0;
}

/* gather: records (uint32 index, float32 x[index]) */
EXPORT void records_gather_u32_f32(const float *x, const uint32_t *idx, int64_t k, uint8_t *rec) {
    for (int64_t i = 0; i < k; i++) {
        memcpy(rec + 8 * i, idx + i, 4);
        memcpy(rec + 8 * i + 4, x + idx[i], 4);
    }
}

/* ---------------------------------------------------------------- PowerSGD */

/* The first n elements of P Q^T (P: rows x r, row-major; qt = Q^T: r x cols, row-major), row by
 * row, summed in order k = 0..r-1. Ranks up to 4 keep the partial sums in registers (one write
 * per element); larger ones add row by row. */
#define LOWRANK_ROW(R)                                                            \
    for (int64_t j = 0; j < len; j++) {                                           \
        float s = a[0] * qt[j];                                                   \
        for (int k = 1; k < R; k++) s = s + a[k] * qt[k * cols + j];              \
        o[j] = s;                                                                 \
    }
EXPORT HOT void lowrank_product_f32(const float *p, const float *qt, int64_t rows, int64_t cols,
                                    int64_t r, int64_t n, float *out) {
    for (int64_t i = 0; i < rows; i++) {
        int64_t start = i * cols, len = n - start < cols ? n - start : cols;
        if (len <= 0) break;
        float *o = out + start;
        const float *a = p + i * r;
        switch (r) {
        case 1: LOWRANK_ROW(1) break;
        case 2: LOWRANK_ROW(2) break;
        case 3: LOWRANK_ROW(3) break;
        case 4: LOWRANK_ROW(4) break;
        default:
            for (int64_t j = 0; j < len; j++) o[j] = a[0] * qt[j];
            for (int64_t k = 1; k < r; k++)
                for (int64_t j = 0; j < len; j++) o[j] = o[j] + a[k] * qt[k * cols + j];
        }
    }
}

/* PowerSGD's first phase in one pass: m = x + err (the first n elements of the rows x cols
 * matrix; the padding stays zero) and P = m Q, with qt = Q^T (r x cols). Each row's r dot
 * products keep eight partial sums a vector. */
typedef float v8f __attribute__((vector_size(32)));
EXPORT HOT void powersgd_p_f32(const float *x, const float *err, int64_t n, int64_t rows, int64_t cols,
                               const float *qt, int64_t r, float *m, float *p) {
    for (int64_t i = 0; i < rows; i++) {
        int64_t start = i * cols, len = n - start < cols ? n - start : cols;
        float *mi = m + start;
        for (int64_t j = 0; j < len; j++) mi[j] = x[start + j] + err[start + j];
        for (int64_t k = 0; k < r; k++) {
            const float *q = qt + k * cols;
            v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t j = 0;
            for (; j + 8 <= cols; j += 8) {
                v8f a, b;
                memcpy(&a, mi + j, 32);
                memcpy(&b, q + j, 32);
                acc += a * b;
            }
            float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            for (; j < cols; j++) s += mi[j] * q[j];
            p[i * r + k] = s;
        }
    }
}

/* The second phase: qt = (m^T P)^T (r x cols), row by row into r running sums per column. */
EXPORT HOT void powersgd_q_f32(const float *m, int64_t rows, int64_t cols, const float *p, int64_t r,
                               float *qt) {
    memset(qt, 0, sizeof(float) * (size_t)(r * cols));
    for (int64_t i = 0; i < rows; i++) {
        const float *mi = m + i * cols;
        for (int64_t k = 0; k < r; k++) {
            float a = p[i * r + k];
            float *q = qt + k * cols;
            for (int64_t j = 0; j < cols; j++) q[j] = q[j] + a * mi[j];
        }
    }
}
