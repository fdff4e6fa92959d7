/* TernGrad and QSGD (our formats, docs/codecs.md), and the scans and fused updates that the
 * sparse codecs, DGC and error feedback share. */
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
    EXPORT HOT int64_t key_collect_##SUFFIX(const UT *u, int64_t n, uint64_t thr, uint32_t *idx, int64_t cap) { \
        int64_t m = 0;                                                            \
        for (int64_t i = 0; i < n; i++) {                                         \
            if ((uint64_t)(u[i] & MASK) >= thr) {                                 \
                if (m < cap) idx[m] = (uint32_t)i;                                \
                m++;                                                              \
            }                                                                     \
        }                                                                         \
        return m;                                                                 \
    }
DEFINE_COLLECT_IDX(uint32_t, 0x7fffffffu, u32)
DEFINE_COLLECT_IDX(uint16_t, 0x7fffu, u16)

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

/* sum(x) and sum(x*x) in float64, eight interleaved accumulators each. */
EXPORT HOT void moments_f32(const float *x, int64_t n, double *out) {
    double s[8] = {0}, q[8] = {0};
    for (int64_t i = 0; i < n; i++) {
        double v = x[i];
        s[i & 7] += v;
        q[i & 7] += v * v;
    }
    out[0] = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    out[1] = ((q[0] + q[4]) + (q[1] + q[5])) + ((q[2] + q[6]) + (q[3] + q[7]));
}

/* ---------------------------------------------------------------- random draws */

/* Bernoulli(p) from 32 random bits r: P(r < p * 2^32) = ceil(p * 2^32) / 2^32, unbiased to
 * 2^-32. Two draws per xorshift128+ output (high half first). */
static inline int bern32(uint32_t r, float p) { return (double)r < (double)p * 4294967296.0; }

/* ---------------------------------------------------------------- TernGrad */

/* code per element, 2 bits, 4 per byte from the least significant end: 0 zero, 1 +1, 2 -1.
 * p = min(|x|, c) / s (s > 0 and finite, c the clip bound or inf). */
EXPORT HOT void terngrad_compress_f32(const float *x, int64_t n, float c, float s, uint64_t *state,
                                      uint8_t *codes) {
    memset(codes, 0, (size_t)((n + 3) / 4));
    uint64_t r = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!(i & 1)) r = xs_next(state);
        uint32_t bits = (i & 1) ? (uint32_t)r : (uint32_t)(r >> 32);
        float a = fabsf(x[i]);
        a = a < c ? a : c;
        unsigned keep = bern32(bits, a / s);
        unsigned code = keep ? (x[i] < 0 ? 2u : 1u) : 0u;
        codes[i >> 2] |= (uint8_t)(code << (2 * (i & 3)));
    }
}

/* y = scale * {0, +1, -1}[code]; a code of 3, or a nonzero padding code, is malformed. */
EXPORT HOT int64_t terngrad_decompress_f32(const uint8_t *codes, int64_t n, float scale, float *y) {
    int64_t nbytes = (n + 3) / 4;
    for (int64_t j = 0; j < nbytes; j++) {
        uint8_t b = codes[j];
        if ((b & (b >> 1) & 0x55) != 0) return ERR_CODE;
    }
    if (n & 3) {
        if (codes[nbytes - 1] >> (2 * (n & 3))) return ERR_CODE;
    }
    const float val[4] = {0.0f * scale, scale, -scale, 0.0f};
    for (int64_t i = 0; i < n; i++) y[i] = val[(codes[i >> 2] >> (2 * (i & 3))) & 3];
    return 0;
}

/* ---------------------------------------------------------------- QSGD */

/* code per element (level << 1 | sign), `bits` wide, packed from the least significant bit of
 * a little-endian bit stream. level = floor(l) + Bernoulli(l - floor(l)), l = |x| * mult,
 * capped at q. */
EXPORT HOT int64_t qsgd_compress_f32(const float *x, int64_t n, float mult, uint32_t q, int bits,
                                     uint64_t *state, uint8_t *out) {
    uint64_t acc = 0, r = 0;
    int cnt = 0;
    uint8_t *p = out;
    for (int64_t i = 0; i < n; i++) {
        if (!(i & 1)) r = xs_next(state);
        uint32_t rb = (i & 1) ? (uint32_t)r : (uint32_t)(r >> 32);
        float l = fabsf(x[i]) * mult;
        float f = floorf(l);
        uint32_t level = (uint32_t)f + (uint32_t)bern32(rb, l - f);
        level = level > q ? q : level;
        uint64_t code = ((uint64_t)level << 1) | (uint64_t)(x[i] < 0 && level);
        acc |= code << cnt;
        cnt += bits;
        while (cnt >= 8) { *p++ = (uint8_t)acc; acc >>= 8; cnt -= 8; }
    }
    if (cnt) *p++ = (uint8_t)acc;
    return p - out;
}

EXPORT HOT int64_t qsgd_decompress_f32(const uint8_t *in, int64_t nbytes, int64_t n, uint32_t q,
                                       int bits, float scale, float *y) {
    if (nbytes != (n * bits + 7) / 8) return ERR_TRUNCATED;
    uint64_t acc = 0, mask = ((uint64_t)1 << bits) - 1;
    int cnt = 0;
    const uint8_t *p = in;
    for (int64_t i = 0; i < n; i++) {
        while (cnt < bits) { acc |= (uint64_t)(*p++) << cnt; cnt += 8; }
        uint64_t code = acc & mask;
        acc >>= bits;
        cnt -= bits;
        uint32_t level = (uint32_t)(code >> 1);
        if (level > q) return ERR_CODE;
        float v = (float)level * scale;
        y[i] = (code & 1) ? -v : v;
    }
    if (acc) return ERR_CODE; /* padding bits must be zero */
    return 0;
}

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
 * zero_first ? y = scatter : y += scatter. Everything is checked before anything is written. */
EXPORT HOT int64_t sorted_records_add_f32(const uint8_t *rec, int64_t k, int64_t n, float *y, int zero_first) {
    int64_t prev = -1;
    for (int64_t i = 0; i < k; i++) {
        uint32_t idx;
        memcpy(&idx, rec + 8 * i, 4);
        if ((int64_t)idx <= prev || (int64_t)idx >= n) return ERR_INDEX;
        prev = idx;
    }
    if (zero_first) memset(y, 0, sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < k; i++) {
        uint32_t idx;
        float v;
        memcpy(&idx, rec + 8 * i, 4);
        memcpy(&v, rec + 8 * i + 4, 4);
        y[idx] += v;
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
