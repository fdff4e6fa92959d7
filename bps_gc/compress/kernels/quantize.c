/* TernGrad and QSGD (our formats, docs/codecs.md). */
#include "common.h"

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
/* The sign comes from the sign bit (a -0.0 is never kept): compilers turn `xi < 0` into a
 * branch, which mispredicts half the time on gradients. */
static inline unsigned tern_code(float xi, uint32_t bits, float c, float s) {
    uint32_t sb;
    memcpy(&sb, &xi, 4);
    float a = fabsf(xi);
    a = a < c ? a : c;
    return bern32(bits, a / s) * (1u + (sb >> 31));
}

EXPORT HOT void terngrad_compress_f32(const float *x, int64_t n, float c, float s, uint64_t *state,
                                      uint8_t *codes) {
    uint64_t st[2] = {state[0], state[1]}; /* a local copy: byte stores may alias state */
    int64_t full = n / 4;
    for (int64_t j = 0; j < full; j++) { /* four codes, two draws, one byte */
        const float *p = x + 4 * j;
        uint64_t r0 = xs_next(st), r1 = xs_next(st);
        codes[j] = (uint8_t)(tern_code(p[0], (uint32_t)(r0 >> 32), c, s) |
                             tern_code(p[1], (uint32_t)r0, c, s) << 2 |
                             tern_code(p[2], (uint32_t)(r1 >> 32), c, s) << 4 |
                             tern_code(p[3], (uint32_t)r1, c, s) << 6);
    }
    if (n & 3) {
        unsigned byte = 0;
        uint64_t r = 0;
        for (int64_t i = 4 * full; i < n; i++) {
            if (!(i & 1)) r = xs_next(st);
            byte |= tern_code(x[i], (i & 1) ? (uint32_t)r : (uint32_t)(r >> 32), c, s) << (2 * (i & 3));
        }
        codes[full] = (uint8_t)byte;
    }
    state[0] = st[0];
    state[1] = st[1];
}

/* AVX2: eight codes (two bytes) per step, each lane shifting its own code down and picking
 * its value from the four-entry table with a permute. */
__attribute__((target("avx2"))) static void terngrad_expand_avx2(const uint8_t *codes, int64_t groups,
                                                                 const float *val, float *y) {
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), three = _mm256_set1_epi32(3);
    const __m256 table = _mm256_setr_ps(val[0], val[1], val[2], val[3], val[0], val[1], val[2], val[3]);
    for (int64_t g = 0; g < groups; g++) {
        uint16_t w;
        memcpy(&w, codes + 2 * g, 2);
        __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shifts), three);
        _mm256_storeu_ps(y + 8 * g, _mm256_permutevar8x32_ps(table, code));
    }
}

/* y = scale * {0, +1, -1}[code]; a code of 3, or a nonzero padding code, is malformed. */
EXPORT int64_t terngrad_decompress_f32(const uint8_t *codes, int64_t n, float scale, float *y) {
    int64_t nbytes = (n + 3) / 4;
    uint8_t bad = 0;
    for (int64_t j = 0; j < nbytes; j++) bad |= codes[j] & (codes[j] >> 1) & 0x55;
    if (bad) return ERR_CODE;
    if ((n & 3) && (codes[nbytes - 1] >> (2 * (n & 3)))) return ERR_CODE;
    const float val[4] = {0.0f * scale, scale, -scale, 0.0f};
    int64_t done = 0;
    if (__builtin_cpu_supports("avx2")) {
        terngrad_expand_avx2(codes, n / 8, val, y);
        done = n / 8 * 8;
    }
    for (int64_t i = done; i < n; i++) y[i] = val[(codes[i >> 2] >> (2 * (i & 3))) & 3];
    return 0;
}

/* ---------------------------------------------------------------- QSGD */

/* code per element (level << 1 | sign), `bits` wide, packed from the least significant bit of
 * a little-endian bit stream. level = floor(l) + Bernoulli(l - floor(l)), l = |x| * mult,
 * capped at q. Two codes per draw, then one unconditional 8-byte store that advances by the
 * whole bytes written (no branch); the output needs 8 bytes of slack. */
static inline uint64_t qsgd_code(float xi, uint32_t rb, float mult, uint32_t q) {
    uint32_t sb;
    memcpy(&sb, &xi, 4); /* the sign bit, not `x < 0`, which compiles to a branch */
    float l = fabsf(xi) * mult;
    float f = floorf(l);
    uint32_t level = (uint32_t)f + (uint32_t)bern32(rb, l - f);
    level = level > q ? q : level;
    return ((uint64_t)level << 1) | (uint64_t)((sb >> 31) & (level != 0));
}

EXPORT HOT int64_t qsgd_compress_f32(const float *x, int64_t n, float mult, uint32_t q, int bits,
                                     uint64_t *state, uint8_t *out) {
    uint64_t acc = 0, st[2] = {state[0], state[1]}; /* local: byte stores may alias */
    int cnt = 0;
    uint8_t *p = out;
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
        uint64_t r = xs_next(st);
        acc |= qsgd_code(x[i], (uint32_t)(r >> 32), mult, q) << cnt;
        cnt += bits;
        acc |= qsgd_code(x[i + 1], (uint32_t)r, mult, q) << cnt;
        cnt += bits; /* <= 7 + 50 */
        memcpy(p, &acc, 8);
        int adv = cnt >> 3;
        p += adv;
        acc >>= 8 * adv;
        cnt &= 7;
    }
    if (i < n) {
        uint64_t r = xs_next(st);
        acc |= qsgd_code(x[i], (uint32_t)(r >> 32), mult, q) << cnt;
        cnt += bits;
    }
    while (cnt > 0) { *p++ = (uint8_t)acc; acc >>= 8; cnt -= 8; }
    state[0] = st[0];
    state[1] = st[1];
    return p - out;
}

static inline float qsgd_value(uint64_t code, float scale) {
    float v = (float)(uint32_t)(code >> 1) * scale;
    uint32_t b;
    memcpy(&b, &v, 4);
    b ^= (uint32_t)(code & 1) << 31; /* the sign without a branch */
    memcpy(&v, &b, 4);
    return v;
}

/* Element i's code starts at bit i*bits: one unaligned 8-byte load at byte (i*bits)/8, shifted
 * by the rest (bits <= 25, so it always fits). Returns the largest code seen. */
static uint64_t qsgd_decode_scalar(const uint8_t *in, int64_t from, int64_t to, int bits, float scale, float *y) {
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    uint64_t worst = 0;
    for (int64_t i = from; i < to; i++) {
        uint64_t pos = (uint64_t)i * bits, w;
        memcpy(&w, in + (pos >> 3), 8);
        uint64_t code = (w >> (pos & 7)) & mask;
        worst = code > worst ? code : worst;
        y[i] = qsgd_value(code, scale);
    }
    return worst;
}

/* AVX2: eight elements (8 * bits bits, a whole number of bytes) per step. Each 128-bit lane
 * loads the bytes of four codes, a byte shuffle puts each code's 4-byte window in its 32-bit
 * slot, a per-slot shift and mask leave the code. */
__attribute__((target("avx2"))) static uint64_t qsgd_decode_avx2(const uint8_t *in, int64_t groups, int bits,
                                                                 float scale, float *y) {
    int8_t shuf[32];
    int32_t shift[8];
    int lane_byte = (4 * bits) >> 3;
    for (int t = 0; t < 8; t++) {
        int off = t * bits - (t >= 4 ? lane_byte * 8 : 0);
        shift[t] = off & 7;
        for (int b = 0; b < 4; b++) shuf[4 * t + b] = (int8_t)((off >> 3) + b);
    }
    const __m256i sh = _mm256_loadu_si256((const __m256i *)shuf), sv = _mm256_loadu_si256((const __m256i *)shift);
    const __m256i mask = _mm256_set1_epi32((int)(((uint64_t)1 << bits) - 1));
    const __m256 sc = _mm256_set1_ps(scale);
    __m256i worst = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = in + g * bits; /* 8 codes = bits bytes */
        __m256i raw = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + lane_byte)),
                                       _mm_loadu_si128((const __m128i *)p));
        __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(raw, sh), sv), mask);
        worst = _mm256_max_epu32(worst, code);
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(code, 1)), sc);
        __m256i sign = _mm256_slli_epi32(code, 31); /* bit 0, the sign, to bit 31 */
        _mm256_storeu_ps(y + 8 * g, _mm256_xor_ps(v, _mm256_castsi256_ps(sign)));
    }
    uint32_t w[8];
    _mm256_storeu_si256((__m256i *)w, worst);
    uint32_t m = 0;
    for (int t = 0; t < 8; t++) m = w[t] > m ? w[t] : m;
    return m;
}

/* The last elements, whose 8- or 16-byte loads would run past the payload, read from a
 * zero-padded copy. y is scratch until this returns 0. */
EXPORT int64_t qsgd_decompress_f32(const uint8_t *in, int64_t nbytes, int64_t n, uint32_t q,
                                   int bits, float scale, float *y) {
    if (nbytes != (n * bits + 7) / 8) return ERR_TRUNCATED;
    uint64_t maxcode = ((uint64_t)q << 1) | 1, worst = 0;
    int64_t safe = 0;
    if (__builtin_cpu_supports("avx2") && nbytes >= 32) {
        int64_t groups = (nbytes - 32) / bits; /* each group reads at most bits + 16 bytes */
        if (groups > n / 8) groups = n / 8;
        worst = qsgd_decode_avx2(in, groups, bits, scale, y);
        safe = 8 * groups;
    } else {
        safe = nbytes >= 8 ? ((nbytes - 8) * 8) / bits : 0; /* elements whose load fits */
        if (safe > n) safe = n;
        worst = qsgd_decode_scalar(in, 0, safe, bits, scale, y);
    }
    uint8_t tail[64] = {0};
    int64_t base = (safe * bits) >> 3;
    memcpy(tail, in + base, (size_t)(nbytes - base)); /* < 56 bytes */
    uint64_t w2 = qsgd_decode_scalar(tail, 0, n - safe, bits, scale, y + safe);
    worst = w2 > worst ? w2 : worst;
    if (worst > maxcode) return ERR_CODE; /* a level above q */
    uint64_t used = (uint64_t)n * bits;
    if (used & 7 && (in[nbytes - 1] >> (used & 7))) return ERR_CODE; /* padding bits must be zero */
    return 0;
}

