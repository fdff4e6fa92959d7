#include "common.h"
#include "bitstream.h"

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

