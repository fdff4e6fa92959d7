/* Hot loops of the bps_gc codecs, called through ctypes from the numpy wrappers in this folder.
 *
 * Pure C, no Python API: the wrappers own every buffer and pass raw pointers. Every decoder
 * validates what it reads (payloads arrive from the network) and returns a negative error code
 * instead of touching memory out of bounds. Built with -ffp-contract=off so that float math
 * rounds exactly like numpy and BytePS (no fused multiply-add).
 *
 * Word layout (codecs.md): bits are packed MSB first into words of W (uint16/32/64), each word
 * stored little-endian.
 */
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

EXPORT void rng_fill(uint64_t *state, int64_t n, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = xs_next(state);
}

/* randomk: k draws of randint(0, n) with replacement, in draw order. */
EXPORT void randomk_indices(uint64_t *state, int64_t n, int64_t k, uint32_t *idx) {
    for (int64_t i = 0; i < k; i++) idx[i] = (uint32_t)(xs_next(state) % (uint64_t)n);
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
    }                                                                             \
    EXPORT HOT void onebit_decompress_##SUFFIX(const W *words, float scale, int64_t n, T *y) { \
        const T pos = (T)scale, neg = -(T)scale;                                  \
        int64_t full = n / BITS;                                                  \
        for (int64_t j = 0; j < full; j++) {                                      \
            W w = words[j];                                                       \
            T *p = y + j * BITS;                                                  \
            PREFETCH_AHEAD(p, BITS * sizeof(T), 1);                               \
            for (int t = 0; t < BITS; t++) p[t] = (w >> (BITS - 1 - t)) & 1 ? neg : pos; \
        }                                                                         \
        for (int64_t i = full * BITS; i < n; i++)                                 \
            y[i] = (words[full] >> (BITS - 1 - (i - full * BITS))) & 1 ? neg : pos; \
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

/* Error feedback's e -= decompress(payload), fused: e[i] -= (bit ? -scale : scale). */
#define DEFINE_ONEBIT_RESIDUAL(T, W, BITS, SUFFIX)                                \
    EXPORT HOT void onebit_residual_##SUFFIX(const W *words, float scale, int64_t n, T *e) { \
        const T pos = (T)scale, neg = -(T)scale;                                  \
        int64_t full = n / BITS;                                                  \
        for (int64_t j = 0; j < full; j++) {                                      \
            W w = words[j];                                                       \
            T *p = e + j * BITS;                                                  \
            PREFETCH_AHEAD(p, BITS * sizeof(T), 1);                               \
            for (int t = 0; t < BITS; t++) p[t] -= (w >> (BITS - 1 - t)) & 1 ? neg : pos; \
        }                                                                         \
        for (int64_t i = full * BITS; i < n; i++)                                 \
            e[i] -= (words[full] >> (BITS - 1 - (i - full * BITS))) & 1 ? neg : pos; \
    }
DEFINE_ONEBIT_RESIDUAL(float, uint32_t, 32, f32)
DEFINE_ONEBIT_RESIDUAL(double, uint64_t, 64, f64)

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
                m = collect_##SUFFIX(x, n, thr, c, cap);                          \
                if (m < 0) break; /* threshold too low for the buffer: use all */ \
            }                                                                     \
            free(smp);                                                            \
            if (m < k) { free(c); c = NULL; m = -1; }                             \
        }                                                                         \
        if (m < 0) {                                                              \
            c = malloc(sizeof(cand_t) * (n ? n : 1));                             \
            if (!c) return ERR_NOMEM;                                             \
            m = collect_##SUFFIX(x, n, 0, c, n);                                  \
        }                                                                         \
        select_best(c, m, k);                                                     \
        for (int64_t i = 0; i < k; i++) idx[i] = c[i].idx;                        \
        free(c);                                                                  \
        return k;                                                                 \
    }
DEFINE_TOPK(float, uint32_t, 0x7fffffffu, f32)
DEFINE_TOPK(double, uint64_t, 0x7fffffffffffffffull, f64)

/* ---------------------------------------------------------------- bit streams */

/* The codecs.md stream is a sequence of W words (little-endian), each filled MSB first. The
 * kernels work on the same bits as a big-endian byte stream, which allows branch-free 8-byte
 * loads and stores at any bit offset, and byteswap each word at the boundary. */
static inline uint64_t load_be64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return __builtin_bswap64(v); }
static inline void store_be64(uint8_t *p, uint64_t v) { v = __builtin_bswap64(v); memcpy(p, &v, 8); }

static void swap_words(uint8_t *p, int64_t nwords, int wbits) {
    if (wbits == 32)
        for (int64_t j = 0; j < nwords; j++) { uint32_t v; memcpy(&v, p + 4 * j, 4); v = __builtin_bswap32(v); memcpy(p + 4 * j, &v, 4); }
    else
        for (int64_t j = 0; j < nwords; j++) { uint64_t v; memcpy(&v, p + 8 * j, 8); v = __builtin_bswap64(v); memcpy(p + 8 * j, &v, 8); }
}

/* Writer: buf holds cnt (< 8) pending bits at its top; every put stores 8 bytes unconditionally
 * and advances by the whole bytes written, so a put of nb = 0 (a masked one) costs no branch.
 * The output needs 8 bytes of slack. */
typedef struct { uint64_t buf; int cnt; uint8_t *p; } bitw_t;

static inline void bw_put(bitw_t *w, uint64_t v, int nb) { /* nb <= 56, v < 2^nb */
    w->buf |= v << ((64 - w->cnt - nb) & 63) & -(uint64_t)(nb != 0);
    w->cnt += nb;
    store_be64(w->p, w->buf);
    int bytes = w->cnt >> 3;
    w->p += bytes;
    w->buf = bytes ? w->buf << (bytes * 8) : w->buf;
    w->cnt &= 7;
}

/* bw_put for 1 <= nb <= 56 */
static inline void bw_put_nz(bitw_t *w, uint64_t v, int nb) {
    w->buf |= v << (64 - w->cnt - nb);
    w->cnt += nb;
    store_be64(w->p, w->buf);
    int bytes = w->cnt >> 3; /* <= 7 */
    w->p += bytes;
    w->buf <<= bytes * 8;
    w->cnt &= 7;
}

/* Elias-delta(v >= 1) as one code: L zeros, N = bit_length(v) in L+1 bits, the low N-1 bits of
 * v, i.e. the value (N-1) * 2^(N-1) + v written in 2L + N bits. */
static inline int elias_code(uint64_t v, uint64_t *code) {
    int N = 64 - __builtin_clzll(v);
    int L = 31 - __builtin_clz((unsigned)N);
    *code = ((uint64_t)(N - 1) << (N - 1)) + v;
    return 2 * L + N;
}

/* Reader over a big-endian copy of the stream with 8 zero bytes of padding. Decodes one
 * Elias-delta value starting `skip` bits into w (the next 64 bits); returns its bit length, or
 * 0 when malformed (more than 5 leading zeros, or longer than the window). */
static inline int elias_peek(uint64_t w, int skip, uint64_t *v) {
    w <<= skip;
    if (!w) return 0;
    int L = __builtin_clzll(w);
    if (L > 5) return 0;
    int N = (int)(w >> (63 - 2 * L));
    int len = 2 * L + N;
    if (len + skip > 57) return 0;
    uint64_t low = ((w << (2 * L + 1)) >> 1) >> (63 - (N - 1));
    *v = ((uint64_t)1 << (N - 1)) | low;
    return len;
}

/* ---------------------------------------------------------------- dithering */

/* Decoder fast path: for every DITH_TAB_BITS-bit prefix that holds a whole (gap, sign, level)
 * triple, len | gap << 8 | (sign * 64 + level) << 16 (gap, level < 64); 0 otherwise. Built
 * once when the library loads, with elias_peek itself. */
#define DITH_TAB_BITS 12
static uint32_t dith_tab[1 << DITH_TAB_BITS];
/* Encoder: elias_code(v) for 1 <= v < 256 as code | length << 16 (entry 0 unused). */
static uint32_t elias_tab[256];

__attribute__((constructor)) static void dith_tab_init(void) {
    for (uint32_t b = 0; b < (1u << DITH_TAB_BITS); b++) {
        uint64_t w = (uint64_t)b << (64 - DITH_TAB_BITS), gap, q;
        int glen = elias_peek(w, 0, &gap);
        if (!glen || glen + 1 >= DITH_TAB_BITS) continue;
        int qlen = elias_peek(w << glen, 1, &q);
        int len = glen + 1 + qlen;
        if (!qlen || len > DITH_TAB_BITS) continue;
        uint32_t sign = (uint32_t)(w << glen >> 63);
        dith_tab[b] = (uint32_t)len | (uint32_t)gap << 8 | (sign * 64 + (uint32_t)q) << 16;
    }
    for (uint64_t v = 1; v < 256; v++) {
        uint64_t code;
        int len = elias_code(v, &code);
        elias_tab[v] = (uint32_t)code | (uint32_t)len << 16;
    }
}

static inline uint32_t next_pow2(uint32_t v) {
    if (v == 0) return 0;
    return v == 1 ? 1 : (uint32_t)1 << (32 - __builtin_clz(v - 1));
}

#define DITHER_BLOCK 1024
#define DITH_ZERO_CHUNK 4096

/* Pass (b) of the encoder over one block: q = f + len * bernoulli(p) (len = 1 when NULL), one
 * draw per element in index order, listing the nonzero (index, q) without branches. Returns
 * their count. With AVX-512 the uint64 -> double cast is one instruction; elsewhere the
 * branch-free u64_to_double (same value) avoids a mispredicted branch per draw. */
#define DEFINE_DITHER_DRAW(NAME, ATTR, TO_DOUBLE)                                      \
    static ATTR int NAME(uint64_t *st, int bn, const uint32_t *f, const uint32_t *len,  \
                         const double *p, int32_t *nzi, uint32_t *nzq) {                \
        uint64_t s[2] = {st[0], st[1]};                                                 \
        int m = 0;                                                                      \
        if (!len)                                                                       \
            for (int i = 0; i < bn; i++) {                                              \
                uint32_t q = f[i] + (TO_DOUBLE(xs_next(s)) < p[i] * 18446744073709551616.0); \
                nzi[m] = i;                                                             \
                nzq[m] = q;                                                             \
                m += q != 0;                                                            \
            }                                                                           \
        else                                                                            \
            for (int i = 0; i < bn; i++) {                                              \
                uint32_t q = f[i] + len[i] * (TO_DOUBLE(xs_next(s)) < p[i] * 18446744073709551616.0); \
                nzi[m] = i;                                                             \
                nzq[m] = q;                                                             \
                m += q != 0;                                                            \
            }                                                                           \
        st[0] = s[0];                                                                   \
        st[1] = s[1];                                                                   \
        return m;                                                                       \
    }
#define CAST_TO_DOUBLE(v) ((double)(v))
DEFINE_DITHER_DRAW(dither_draw_avx512, __attribute__((target("avx512f"))), CAST_TO_DOUBLE)
DEFINE_DITHER_DRAW(dither_draw_generic, , u64_to_double)

/* The same for len = 1 with AVX-512 DQ: the draws first (the sequential part), then 16 at a
 * time the compare (vcvtuqq2pd rounds like the cast), q and a compress of the nonzero ones.
 * Stores 16 entries at nzi + m, nzq + m (m + 16 <= bn: room in the block arrays). */
__attribute__((target("avx512f,avx512dq"))) static int dither_draw_linear_avx512dq(
    uint64_t *st, int bn, const uint32_t *f, const double *p, int32_t *nzi, uint32_t *nzq) {
    uint64_t s[2] = {st[0], st[1]}, r[DITHER_BLOCK];
    for (int i = 0; i < bn; i++) r[i] = xs_next(s);
    st[0] = s[0];
    st[1] = s[1];
    const __m512d two64 = _mm512_set1_pd(18446744073709551616.0);
    const __m512i one = _mm512_set1_epi32(1), sixteen = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int m = 0, i = 0;
    for (; i + 16 <= bn; i += 16) {
        __m512d d0 = _mm512_cvtepu64_pd(_mm512_loadu_si512(r + i));
        __m512d d1 = _mm512_cvtepu64_pd(_mm512_loadu_si512(r + i + 8));
        __mmask8 b0 = _mm512_cmp_pd_mask(d0, _mm512_mul_pd(_mm512_loadu_pd(p + i), two64), _CMP_LT_OQ);
        __mmask8 b1 = _mm512_cmp_pd_mask(d1, _mm512_mul_pd(_mm512_loadu_pd(p + i + 8), two64), _CMP_LT_OQ);
        __mmask16 b = (__mmask16)((unsigned)b0 | (unsigned)b1 << 8);
        __m512i fv = _mm512_loadu_si512(f + i);
        __m512i q = _mm512_mask_add_epi32(fv, b, fv, one);
        __mmask16 nz = _mm512_test_epi32_mask(q, q);
        _mm512_storeu_si512(nzi + m, _mm512_maskz_compress_epi32(nz, idx));
        _mm512_storeu_si512(nzq + m, _mm512_maskz_compress_epi32(nz, q));
        m += __builtin_popcount(nz);
        idx = _mm512_add_epi32(idx, sixteen);
    }
    for (; i < bn; i++) {
        uint32_t q = f[i] + ((double)r[i] < p[i] * 18446744073709551616.0);
        nzi[m] = i;
        nzq[m] = q;
        m += q != 0;
    }
    return m;
}

/* Clones for pass (a) below, which vectorizes with 512-, 256- or 128-bit vectors. */
#define DITHER_HOT __attribute__((target_clones("avx512f", "avx2", "default")))


/* Scale: max |x| or sqrt(sum(x*x)) with the product in the element type, summed in float64
 * sequentially (the order BytePS used, so the stored float32 scale matches byte for byte).
 *
 * Encoding runs per block of DITHER_BLOCK elements in three passes: (a) floor level f, step
 * len and probability p per element, branch-free and vectorizable; (b) the sequential part, one
 * bernoulli draw per element in index order, appending the nonzero levels to a list without
 * branches; (c) the bit writer, over the nonzero levels only. */
#define DEFINE_DITHER(T, W, BITS, SUFFIX)                                         \
    static double dithering_scale_##SUFFIX(const T *x, int64_t n, int l2) {       \
        if (l2) {                                                                 \
            double s = 0.0;                                                       \
            for (int64_t i = 0; i < n; i++) { T sq = x[i] * x[i]; s += (double)sq; } \
            return sqrt(s);                                                       \
        }                                                                         \
        /* max |x| as the max of the abs bit patterns: same value, vectorizes, and a NaN \
         * (whose pattern is above inf's) yields a non-finite scale */            \
        const W *u = (const W *)x;                                                \
        W m = 0;                                                                  \
        for (int64_t c = 0; c < n; c += 1024) { /* chunks of 1024, prefetched ahead */ \
            int64_t ce = n - c < 1024 ? n : c + 1024;                             \
            PREFETCH_AHEAD(u + c, 1024 * sizeof(W), 0);                           \
            for (int64_t i = c; i < ce; i++) { W a = u[i] & (W) ~((W)1 << (BITS - 1)); m = m > a ? m : a; } \
        }                                                                         \
        T v;                                                                      \
        memcpy(&v, &m, sizeof v);                                                 \
        return (double)v;                                                         \
    }                                                                             \
    /* Encode x into out (cap bytes): the words, the bit count as a W, the scale as float32. \
     * Returns the payload size or ERR_OVERFLOW (the RNG state is then left untouched, and \
     * the wrapper retries with room for the worst case). */                     \
    EXPORT DITHER_HOT int64_t dithering_compress_##SUFFIX(const T *x, int64_t n, int s, int natural, \
                                                          int l2, uint64_t *rng, uint8_t *out, int64_t cap) { \
        double S = dithering_scale_##SUFFIX(x, n, l2);                            \
        if (!isfinite(S)) return ERR_NONFINITE;                                   \
        const int wb = BITS / 8;                                                  \
        if (cap < 11 + 8 + 2 * wb + 4) return ERR_OVERFLOW;                       \
        /* room after the last check: one element (<= 11 bytes), 8 bytes of store slack, \
         * the last word's padding, the bit count and the scale */                \
        const uint8_t *end = out + cap - (11 + 8 + 2 * wb + 4);                   \
        uint64_t st[2] = {rng[0], rng[1]};                                        \
        bitw_t w = {0, 0, out};                                                   \
        int64_t prev = -1, total = 0;                                             \
        const double level = natural ? (double)((uint32_t)1 << (s - 1)) : (double)s; \
        const int avx512 = __builtin_cpu_supports("avx512f");                     \
        const int avx512dq = avx512 && __builtin_cpu_supports("avx512dq");        \
        double p[DITHER_BLOCK];                                                   \
        uint32_t f[DITHER_BLOCK], len[DITHER_BLOCK], nzq[DITHER_BLOCK];           \
        int32_t nzi[DITHER_BLOCK + 1];                                            \
        for (int64_t b0 = 0; b0 < n && S != 0.0; b0 += DITHER_BLOCK) {            \
            int bn = n - b0 < DITHER_BLOCK ? (int)(n - b0) : DITHER_BLOCK;        \
            const T *xb = x + b0;                                                 \
            int bad = 0;                                                          \
            if (!natural && level < 4194304.0) {                                  \
                /* The same as the loop below, written to vectorize: 0 <= u < 2^23 \
                 * makes the int32 truncation equal floorf(u), and a bad lane is \
                 * zeroed by mask (the block is rejected anyway). */              \
                const float lim = 2.0f * (float)level;                            \
                for (int i = 0; i < bn; i++) {                                    \
                    float u = (float)(fabs((double)xb[i]) / S * level);           \
                    int ok = u <= lim;                                            \
                    bad |= !ok;                                                   \
                    uint32_t ub;                                                  \
                    memcpy(&ub, &u, 4);                                           \
                    ub &= -(uint32_t)ok;                                          \
                    memcpy(&u, &ub, 4);                                           \
                    int32_t fi = (int32_t)u;                                      \
                    f[i] = (uint32_t)fi;                                          \
                    p[i] = (double)(u - (float)fi);                               \
                }                                                                 \
            } else if (!natural) {                                                \
                for (int i = 0; i < bn; i++) {                                    \
                    float u = (float)(fabs((double)xb[i]) / S * level);           \
                    /* NaN only: with l2, sqrt(sum(float32(x*x))) may round a hair \
                     * below |x|, so u can exceed the top level slightly (as in BytePS) */ \
                    bad |= !(u <= 2.0f * (float)level);                           \
                    u = u <= 2.0f * (float)level ? u : 0.0f;                      \
                    float fl = floorf(u);                                         \
                    f[i] = (uint32_t)fl;                                          \
                    p[i] = (double)(u - fl);                                      \
                }                                                                 \
            } else {                                                              \
                for (int i = 0; i < bn; i++) {                                    \
                    double u = fabs((double)xb[i]) / S * level;                   \
                    bad |= !(u <= 2.0 * level);                                   \
                    uint32_t fl = next_pow2((uint32_t)ceil(u <= 2.0 * level ? u : 0)) >> 1; \
                    f[i] = fl;                                                    \
                    len[i] = fl ? fl : 1;                                         \
                    p[i] = (u - fl) / len[i];                                     \
                }                                                                 \
            }                                                                     \
            if (bad) return ERR_NONFINITE;                                        \
            int m = !natural && avx512dq ? dither_draw_linear_avx512dq(st, bn, f, p, nzi, nzq) \
                  : (avx512 ? dither_draw_avx512 : dither_draw_generic)(st, bn, f, natural ? len : NULL, p, nzi, nzq); \
            for (int j = 0; j < m; j++) {                                         \
                if (w.p > end) return ERR_OVERFLOW;                               \
                int64_t i = b0 + nzi[j];                                          \
                uint64_t gap = (uint64_t)(i - prev), sign = signbit(xb[nzi[j]]) != 0; \
                uint32_t q = nzq[j];                                              \
                if (gap < 256 && q < 256) { /* the usual case: one put, codes from a table */ \
                    uint32_t ge = elias_tab[gap], qe = elias_tab[q];              \
                    int qlen = (int)(qe >> 16), len = (int)(ge >> 16) + qlen + 1; \
                    bw_put_nz(&w, (uint64_t)(ge & 0xffff) << (qlen + 1) | sign << qlen | (qe & 0xffff), len); \
                    total += len;                                                 \
                } else {                                                          \
                    uint64_t gcode, qcode;                                        \
                    int glen = elias_code(gap, &gcode);                           \
                    int qlen = elias_code(q, &qcode);                             \
                    bw_put(&w, gcode, glen);                                      \
                    bw_put(&w, sign << qlen | qcode, qlen + 1);                   \
                    total += glen + qlen + 1;                                     \
                }                                                                 \
                prev = i;                                                         \
            }                                                                     \
        }                                                                         \
        if (S == 0.0) /* no entries; the RNG still advances once per element */   \
            for (int64_t i = 0; i < n; i++) xs_next(st);                          \
        int64_t nwords = (total + BITS - 1) / BITS;                               \
        memset(w.p + (w.cnt ? 1 : 0), 0, 8); /* zero the last word's padding */   \
        swap_words(out, nwords, BITS);                                            \
        int64_t off = nwords * wb;                                                \
        W t = (W)total;                                                           \
        memcpy(out + off, &t, wb);                                                \
        float fs = (float)S;                                                      \
        memcpy(out + off + wb, &fs, 4);                                           \
        rng[0] = st[0];                                                           \
        rng[1] = st[1];                                                           \
        return off + wb + 4;                                                      \
    }                                                                             \
    static int64_t dith_zero_##SUFFIX(T *y, int64_t from, int64_t to, int64_t n) { \
        if (to > n) to = n;                                                       \
        memset(y + from, 0, sizeof(T) * (to - from));                             \
        return to;                                                                \
    }                                                                             \
    EXPORT HOT int64_t dithering_decompress_##SUFFIX(const uint8_t *in, int64_t nbytes, float s_eff, \
                                                     int64_t n, T *y) {           \
        const int wb = BITS / 8;                                                  \
        if (nbytes < wb + 4 || (nbytes - 4) % wb) return ERR_TRUNCATED;           \
        int64_t nwords = (nbytes - 4) / wb - 1;                                   \
        W total;                                                                  \
        memcpy(&total, in + nwords * wb, wb);                                     \
        float S;                                                                  \
        memcpy(&S, in + nwords * wb + wb, 4);                                     \
        if ((uint64_t)total > (uint64_t)nwords * BITS) return ERR_TRUNCATED;      \
        uint8_t *be = malloc(nwords * wb + 16);                                   \
        if (!be) return ERR_NOMEM;                                                \
        memcpy(be, in, nwords * wb);                                              \
        memset(be + nwords * wb, 0, 16);                                          \
        swap_words(be, nwords, BITS);                                             \
        /* y is zeroed in chunks just ahead of the writes (while they still hit the cache), \
         * zto being the end of the zeroed part; whatever remains is zeroed at the end */ \
        int64_t zto = 0;                                                          \
        T vt[128]; /* the values of the table's levels, index sign * 64 + q */    \
        for (int q = 0; q < 64; q++) {                                            \
            float v = (float)((float)q * S) / s_eff;                              \
            vt[q] = (T)v;                                                         \
            vt[64 + q] = (T)-v;                                                   \
        }                                                                         \
        int64_t idx = -1, pos = 0, end = (int64_t)total, err = 0;                 \
        while (pos < end) {                                                       \
            uint64_t gap, q;                                                      \
            uint64_t win = load_be64(be + (pos >> 3)) << (pos & 7);               \
            uint32_t e = dith_tab[win >> (64 - DITH_TAB_BITS)];                   \
            if (e) {                                                              \
                /* fast path: triples of at most DITH_TAB_BITS bits, decoded from win \
                 * (57 valid bits) while it holds another DITH_TAB_BITS bits and pos \
                 * stays before end */                                            \
                int64_t lim = end - pos - 1, used = 0;                            \
                if (lim > 57 - DITH_TAB_BITS) lim = 57 - DITH_TAB_BITS;           \
                /* <= 16 triples (of >= 3 bits) with gaps < 64 */                 \
                if (idx + 1024 >= zto) zto = dith_zero_##SUFFIX(y, zto, idx + 1024 + DITH_ZERO_CHUNK, n); \
                do {                                                              \
                    used += e & 31;                                               \
                    win <<= e & 31;                                               \
                    idx += (e >> 8) & 255;                                        \
                    if (idx >= n) break;                                          \
                    y[idx] = vt[e >> 16];                                         \
                    e = dith_tab[win >> (64 - DITH_TAB_BITS)];                    \
                } while (e && used <= lim);                                       \
                pos += used;                                                      \
                if (idx >= n) { err = pos > end ? ERR_CODE : ERR_INDEX; break; } \
                if (pos > end) { err = ERR_CODE; break; }                         \
                continue;                                                         \
            }                                                                     \
            int glen = elias_peek(load_be64(be + (pos >> 3)), (int)(pos & 7), &gap); \
            if (!glen) { err = ERR_CODE; break; }                                 \
            pos += glen;                                                          \
            uint64_t w2 = load_be64(be + (pos >> 3)) << (pos & 7);                \
            int qlen = elias_peek(w2, 1, &q);                                     \
            if (!qlen) { err = ERR_CODE; break; }                                 \
            pos += 1 + qlen;                                                      \
            idx += (int64_t)gap;                                                  \
            if (pos > end) { err = ERR_CODE; break; }                             \
            if (idx >= n) { err = ERR_INDEX; break; }                             \
            if (idx >= zto) zto = dith_zero_##SUFFIX(y, zto, idx + 1 + DITH_ZERO_CHUNK, n); \
            float v = (float)((float)q * S) / s_eff;                              \
            y[idx] = (T)((w2 >> 63) ? -v : v);                                    \
        }                                                                         \
        if (zto < n) memset(y + zto, 0, sizeof(T) * (n - zto));                   \
        free(be);                                                                 \
        return err;                                                               \
    }
DEFINE_DITHER(float, uint32_t, 32, f32)
DEFINE_DITHER(double, uint64_t, 64, f64)

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
