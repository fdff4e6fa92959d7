/* Shared by kernels/thc.c (the scalar loops and the dispatch) and thc_{encode,decode}_avx512.c. */
#ifndef BPS_GC_THC_H
#define BPS_GC_THC_H
#include <stdint.h>

#define LOG_STREAM 12
#define THC_STREAM (1 << LOG_STREAM) /* xorshift128+ steps of a block, over 8 lanes (16 lanes: half each) */
#define THC_BLOCK (16 * THC_STREAM) /* elements the 16 streams code at once: 2 per step */

/* Code of one element: u = (y * inv_scale + 1) * half in [0, levels] for |y| <= scale, rounded
 * down after adding r in [0, 1) (stochastic: E = u) or to the nearest (r = 0.5), clamped. */
static inline int64_t thc_code(float y, double inv_scale, double half, double r, int levels) {
    double u = floor(((double)y * inv_scale + 1.0) * half + r);
    return u < 0 ? 0 : u > levels ? levels : (int64_t)u;
}

/* A code decoded alone (error feedback's own share): scale * (2 q / levels - 1) as float32. With
 * a minuend, error feedback's residual minuend - decoded (float32) is written instead. */
static inline float thc_decoded(int64_t q, double scale, int levels) {
    return (float)(scale * (2.0 * (double)q / levels - 1.0));
}

/* Codes (bytes) of y[0..m), the first at an even element index: stochastic with `state`
 * (one xorshift128+ number per two elements, high half first; an odd m leaves the last low
 * half unused), else to the nearest. */
void thc_codes_scalar(const float *y, int64_t m, double inv_scale, int levels, uint64_t *state, uint8_t *codes);


int64_t thc_cache_bytes(void);
int thc_has_avx512(void);
int64_t thc_check_words_avx512(const double *w, int64_t nwords);
void thc_pack_avx512(const float *y, int64_t n, double inv_scale, int levels, int width, int k, int bounded,
                     uint64_t *state, const float *minuend, float *decoded, void *words, int as_int);
int64_t thc_unpack_avx512(const void *words, int64_t nwords, int64_t n, int width, int k, const float *table,
                          float *out, int as_int);
#endif
