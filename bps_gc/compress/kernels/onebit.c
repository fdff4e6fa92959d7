#include "common.h"

/* ---------------------------------------------------------------- onebit */

/* One pass packs the signs (x < 0: +0, -0 and NaN give 0) MSB first into words of BITS bits
 * and, with scaling, sums |x| in float64. The sum uses eight independent accumulators instead
 * of BytePS's one sequential chain (which caps it near 3 GB/s); the float32 scale can differ
 * from the sequential sum only when the two straddle a float32 rounding boundary (never on the
 * BytePS vectors). */
#define DEFINE_ONEBIT(T, W, BITS, SUFFIX)                                         \
    static inline W onebit_word_##SUFFIX(const T *p, int m, double *acc, int scaling) { \
        W w = 0;                                                                  \
        for (int t = 0; t < m; t++) {                                             \
            w |= (W)(p[t] < 0) << (BITS - 1 - t);                                 \
            if (scaling) acc[t & 7] += fabs((double)p[t]);                        \
        }                                                                         \
        return w;                                                                 \
    }                                                                             \
    static float onebit_compress_generic_##SUFFIX(const T *x, int64_t n, int scaling, W *words) { \
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                 \
        int64_t full = n / BITS;                                                  \
        if (scaling)                                                              \
            for (int64_t j = 0; j < full; j++) {                                  \
                PREFETCH_AHEAD(x + j * BITS, BITS * sizeof(T), 0);                \
                words[j] = onebit_word_##SUFFIX(x + j * BITS, BITS, acc, 1);      \
            }                                                                     \
        else                                                                      \
            for (int64_t j = 0; j < full; j++) {                                  \
                PREFETCH_AHEAD(x + j * BITS, BITS * sizeof(T), 0);                \
                words[j] = onebit_word_##SUFFIX(x + j * BITS, BITS, acc, 0);      \
            }                                                                     \
        if (full * BITS < n)                                                      \
            words[full] = onebit_word_##SUFFIX(x + full * BITS, (int)(n - full * BITS), acc, scaling); \
        if (!scaling) return 1.0f;                                                \
        double sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])); \
        return (float)(sum / (double)n);                                          \
    }

DEFINE_ONEBIT(float, uint32_t, 32, f32)
DEFINE_ONEBIT(double, uint64_t, 64, f64)
/* float16 partitions arrive converted to float32 (exact) and pack into 16-bit words. */
DEFINE_ONEBIT(float, uint16_t, 16, f16)

/* AVX2 float32 path, same accumulation order as the generic one (lane j sums the elements
 * with index = j mod 8), so both give identical bytes. Reversing each 8-lane vector before
 * movemask puts element t of a word at bit 31 - t. */
__attribute__((target("avx2"))) static float onebit_compress_avx2_f32(const float *x, int64_t n,
                                                                      int scaling, uint32_t *words) {
    const __m256i rev = _mm256_set_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 zero = _mm256_setzero_ps(), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t full = n / 32;
    for (int64_t j = 0; j < full; j++) {
        uint32_t w = 0;
        PREFETCH_AHEAD(x + j * 32, 128, 0);
        for (int b = 0; b < 4; b++) {
            __m256 v = _mm256_loadu_ps(x + j * 32 + b * 8);
            __m256 r = _mm256_permutevar8x32_ps(v, rev);
            w |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(r, zero, _CMP_LT_OQ)) << (24 - 8 * b);
            if (scaling) {
                __m256 a = _mm256_and_ps(v, absmask);
                lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
                hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
            }
        }
        words[j] = w;
    }
    double acc[8];
    _mm256_storeu_pd(acc, lo);
    _mm256_storeu_pd(acc + 4, hi);
    if (full * 32 < n) words[full] = onebit_word_f32(x + full * 32, (int)(n - full * 32), acc, scaling);
    if (!scaling) return 1.0f;
    double sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    return (float)(sum / (double)n);
}

EXPORT float onebit_compress_f32(const float *x, int64_t n, int scaling, uint32_t *words) {
    if (__builtin_cpu_supports("avx2")) return onebit_compress_avx2_f32(x, n, scaling, words);
    return onebit_compress_generic_f32(x, n, scaling, words);
}
EXPORT float onebit_compress_f64(const double *x, int64_t n, int scaling, uint64_t *words) {
    return onebit_compress_generic_f64(x, n, scaling, words);
}
EXPORT float onebit_compress_f16(const float *x, int64_t n, int scaling, uint16_t *words) {
    return onebit_compress_generic_f16(x, n, scaling, words);
}

/* y[i] = (bit ? -scale : scale), and error feedback's fused e -= decompress(payload): one loop,
 * OP either = or -=. */
#define DEFINE_ONEBIT_EXPAND(NAME, OP, T, W, BITS, SUFFIX)                        \
    EXPORT HOT void onebit_##NAME##_##SUFFIX(const W *words, float scale, int64_t n, T *y) { \
        const T pos = (T)scale, neg = -(T)scale;                                  \
        int64_t full = n / BITS;                                                  \
        for (int64_t j = 0; j < full; j++) {                                      \
            W w = words[j];                                                       \
            T *p = y + j * BITS;                                                  \
            PREFETCH_AHEAD(p, BITS * sizeof(T), 1);                               \
            for (int t = 0; t < BITS; t++) p[t] OP (w >> (BITS - 1 - t)) & 1 ? neg : pos; \
        }                                                                         \
        for (int64_t i = full * BITS; i < n; i++)                                 \
            y[i] OP (words[full] >> (BITS - 1 - (i - full * BITS))) & 1 ? neg : pos; \
    }
DEFINE_ONEBIT_EXPAND(decompress, =, float, uint32_t, 32, f32)
DEFINE_ONEBIT_EXPAND(decompress, =, double, uint64_t, 64, f64)
DEFINE_ONEBIT_EXPAND(decompress, =, float, uint16_t, 16, f16)
DEFINE_ONEBIT_EXPAND(residual, -=, float, uint32_t, 32, f32)
DEFINE_ONEBIT_EXPAND(residual, -=, double, uint64_t, 64, f64)

