/* thc's AVX-512 encoding (kernels/thc.c dispatches here when the CPU has it): the same codes,
 * random bits and words as thc.c's scalar loop, bit for bit.
 *
 * It draws its xorshift128+ numbers in 16 streams at once (two vectors of 8 lanes; one vector
 * for inputs larger than half the last level cache): the state sequence is linear over GF(2),
 * so the state THC_STREAM / 2 steps ahead is a fixed 128 x 128 bit matrix (J) times the state;
 * 16 lanes start at states THC_STREAM / 2 apart and each steps THC_STREAM / 2 times, which
 * yields the same numbers as one stream stepping 8 x THC_STREAM times (8 x 8 transposes put
 * them back in order). */
#include <pthread.h>

#include "common.h"
#include "thc.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,bmi2")))

int thc_has_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("bmi2");
}

/* ---------------------------------------------------------------- the jump */

/* jump[j]: T^(2^j), T one step; column i is the matrix applied to the state with only bit i set */
#define JUMPS 13 /* up to 2^12 = THC_STREAM steps */
static uint64_t jump[JUMPS][128][2];
static pthread_once_t jump_once = PTHREAD_ONCE_INIT;

static void apply(const uint64_t m[128][2], const uint64_t s[2], uint64_t r[2]) {
    uint64_t r0 = 0, r1 = 0;
    for (int i = 0; i < 128; i++) {
        uint64_t bit = 0 - ((s[i >> 6] >> (i & 63)) & 1);
        r0 ^= m[i][0] & bit;
        r1 ^= m[i][1] & bit;
    }
    r[0] = r0;
    r[1] = r1;
}

static void make_jumps(void) { /* T, then each the square of the one before */
    for (int i = 0; i < 128; i++) {
        uint64_t s[2] = {0, 0};
        s[i >> 6] = 1ull << (i & 63);
        xs_next(s);
        jump[0][i][0] = s[0];
        jump[0][i][1] = s[1];
    }
    for (int j = 1; j < JUMPS; j++)
        for (int i = 0; i < 128; i++)
            apply(jump[j - 1], jump[j - 1][i], jump[j][i]);
}

/* ---------------------------------------------------------------- codes */

typedef struct {
    __m512d inv_scale, one, half, levels, unit; /* unit: 2^-32 */
    __m512 inv32;                               /* inv_scale in float32 */
    __m512d half32, nearest32;                  /* half * 2^32, 2^31 */
    __m512i byte4;                              /* byte 4 of each qword of two vectors */
} code_consts;

/* 16 codes of y[0..16) with their 16 uint32 draws r (element order; nearest: + 0.5), as thc.c's
 * thc_code computes them, clamps included (min in double first, so no code above 2^31 reaches
 * the int conversion, then max 0: truncation and floor agree on all that is not clamped). */
AVX512 static inline __m128i codes16(const float *y, __m512i r, int random, const code_consts *c) {
    __m256i q[2];
    for (int h = 0; h < 2; h++) {
        __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(y + 8 * h));
        v = _mm512_mul_pd(_mm512_add_pd(_mm512_mul_pd(v, c->inv_scale), c->one), c->half);
        __m512d add = random ? _mm512_mul_pd(_mm512_cvtepu32_pd(h ? _mm512_extracti64x4_epi64(r, 1)
                                                                      : _mm512_castsi512_si256(r)), c->unit)
                             : _mm512_set1_pd(0.5);
        v = _mm512_min_pd(_mm512_roundscale_pd(_mm512_add_pd(v, add), _MM_FROUND_TO_NEG_INF), c->levels);
        q[h] = _mm256_max_epi32(_mm512_cvttpd_epi32(v), _mm256_setzero_si256());
    }
    return _mm512_cvtepi32_epi8(_mm512_inserti64x4(_mm512_castsi256_si512(q[0]), q[1], 1));
}

/* codes16 when every |y| * inv_scale <= 1 (the own peak within the agreed scale: no clamp).
 * All in units of 2^-32, which scales every rounding exactly: c' = (t + 1) * (half 2^32) and
 * d' = c' + r (r the draw itself) are 2^32 c and 2^32 (c + r) of thc_code, 0 <= d' < 2^40, so
 * the code floor(d' / 2^32) is byte 4 of the truncated d'. t = y * inv_scale in float32 is
 * exact, or below 2^-126 where 1 + t rounds to 1 in float64 anyway. */
AVX512 static inline __m128i codes16_bounded(const float *y, __m512i r, int random, const code_consts *c) {
    __m512i q[2];
    for (int h = 0; h < 2; h++) {
        __m512d v = _mm512_cvtps_pd(_mm256_mul_ps(_mm256_loadu_ps(y + 8 * h), _mm512_castps512_ps256(c->inv32)));
        v = _mm512_mul_pd(_mm512_add_pd(v, c->one), c->half32);
        v = _mm512_add_pd(v, random ? _mm512_cvtepu32_pd(h ? _mm512_extracti64x4_epi64(r, 1) : _mm512_castsi512_si256(r))
                                    : c->nearest32);
        q[h] = _mm512_cvttpd_epu64(v);
    }
    return _mm512_castsi512_si128(_mm512_permutex2var_epi8(q[0], c->byte4, q[1]));
}

/* One xorshift128+ step of 8 lanes (common.h's xs_next); the numbers. */
AVX512 static inline __m512i xs_next8(__m512i *s0, __m512i *s1) {
    __m512i t = *s0, u = *s1;
    *s0 = u;
    t = _mm512_xor_si512(t, _mm512_slli_epi64(t, 23));
    t = _mm512_xor_si512(t, _mm512_srli_epi64(t, 17));
    t = _mm512_xor_si512(_mm512_xor_si512(t, u), _mm512_srli_epi64(u, 26));
    *s1 = t;
    return _mm512_add_epi64(t, u);
}

/* Rows r[0..8) (step j of lane i at r[j] lane i) transposed: r[i] = lane i's 8 steps, each
 * number's halves swapped (high half first: the draws in element order; the last stage's
 * dword permutes do it, where a 128-bit shuffle would not). */
AVX512 static inline void transpose8(__m512i r[8]) {
    const __m512i low = _mm512_setr_epi32(1, 0, 3, 2, 9, 8, 11, 10, 17, 16, 19, 18, 25, 24, 27, 26);
    const __m512i high = _mm512_setr_epi32(5, 4, 7, 6, 13, 12, 15, 14, 21, 20, 23, 22, 29, 28, 31, 30);
    __m512i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm512_unpacklo_epi64(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi64(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm512_shuffle_i64x2(a[i], a[i + 2], 0x88);
        b[i + 1] = _mm512_shuffle_i64x2(a[i + 1], a[i + 3], 0x88);
        b[i + 2] = _mm512_shuffle_i64x2(a[i], a[i + 2], 0xdd);
        b[i + 3] = _mm512_shuffle_i64x2(a[i + 1], a[i + 3], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_permutex2var_epi32(b[i], low, b[i + 4]);
        r[i + 4] = _mm512_permutex2var_epi32(b[i], high, b[i + 4]);
    }
}

/* Codes of y[0..16 << log_lane) into codes, 8 CH lanes of 2^log_lane / CH steps (>= 8 each)
 * advancing st by 8 << log_lane steps; BOUNDED a constant, so each kind is its own loop. With
 * CH = 2 the lanes are two sets of 8 whose steps interleave: each set's step waits on its
 * last one (a chain of five dependent operations), which one set alone leaves the vector
 * units waiting on (1M elements: 7-10% faster with two). */
#define CODES_BLOCK(NAME, CODES16, CH)                                                                 \
    AVX512 static void NAME(const float *y, int log_lane, uint64_t *st, const code_consts *c, uint8_t *codes) { \
        const int log_steps = log_lane - ((CH) == 2);                                                  \
        const int64_t steps = (int64_t)1 << log_steps;                                                 \
        uint64_t start[8 * (CH)][2], last[2][8];                                                       \
        memcpy(start[0], st, 16);                                                                      \
        for (int i = 1; i < 8 * (CH); i++)                                                             \
            apply(jump[log_steps], start[i - 1], start[i]);                                            \
        __m512i s0[CH], s1[CH];                                                                        \
        for (int ch = 0; ch < (CH); ch++) {                                                            \
            const uint64_t(*at)[2] = start + 8 * ch;                                                   \
            s0[ch] = _mm512_set_epi64(at[7][0], at[6][0], at[5][0], at[4][0], at[3][0], at[2][0], at[1][0], at[0][0]); \
            s1[ch] = _mm512_set_epi64(at[7][1], at[6][1], at[5][1], at[4][1], at[3][1], at[2][1], at[1][1], at[0][1]); \
        }                                                                                              \
        for (int64_t t = 0; t < steps; t += 8) {                                                       \
            __m512i r[CH][8];                                                                          \
            for (int j = 0; j < 8; j++)                                                                \
                for (int ch = 0; ch < (CH); ch++)                                                      \
                    r[ch][j] = xs_next8(&s0[ch], &s1[ch]);                                             \
            for (int ch = 0; ch < (CH); ch++) {                                                        \
                transpose8(r[ch]);                                                                     \
                _Pragma("GCC unroll 8") for (int lane = 0; lane < 8; lane++) {                         \
                    int64_t e = 2 * ((8 * ch + lane) * steps + t);                                     \
                    _mm_storeu_si128((__m128i *)(codes + e), CODES16(y + e, r[ch][lane], 1, c));       \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        _mm512_storeu_si512(last[0], s0[(CH)-1]);                                                      \
        _mm512_storeu_si512(last[1], s1[(CH)-1]);                                                      \
        st[0] = last[0][7]; /* the last lane ends where all the lanes' steps end */                    \
        st[1] = last[1][7];                                                                            \
    }
CODES_BLOCK(drawn_block, codes16, 1)
CODES_BLOCK(drawn_block_bounded, codes16_bounded, 1)
CODES_BLOCK(drawn_block2, codes16, 2)
CODES_BLOCK(drawn_block2_bounded, codes16_bounded, 2)

/* Codes rounded to the nearest of y[0..m), m a multiple of 16. */
AVX512 static void nearest_codes(const float *y, int64_t m, int bounded, const code_consts *c, uint8_t *codes) {
    const __m512i none = _mm512_setzero_si512();
    if (bounded)
        for (int64_t i = 0; i < m; i += 16)
            _mm_storeu_si128((__m128i *)(codes + i), codes16_bounded(y + i, none, 0, c));
    else
        for (int64_t i = 0; i < m; i += 16)
            _mm_storeu_si128((__m128i *)(codes + i), codes16(y + i, none, 0, c));
}

/* ---------------------------------------------------------------- packing */

typedef struct {
    int k, width, bits, vector; /* vector: 8 words at a time (k <= 16 lanes of <= 6 bits) */
    uint64_t bytemask, lanemask;
    __m512i lo_idx, hi_idx, pairs, quads;
    __mmask64 hi_mask;
} packer;

AVX512 static void make_packer(packer *p, int k, int width, int bits) {
    p->k = k, p->width = width, p->bits = bits;
    p->bytemask = 0x0101010101010101ull * ((1ull << bits) - 1);
    p->lanemask = 0;
    for (int j = 0; j < k; j++)
        p->lanemask |= ((1ull << bits) - 1) << (width * j);
    p->vector = k >= 8 && k <= 16 && width <= 6;
    if (!p->vector)
        return;
    uint8_t lo[64], hi[64];
    p->hi_mask = 0;
    for (int l = 0; l < 8; l++)
        for (int j = 0; j < 8; j++) {
            lo[8 * l + j] = (uint8_t)(l * k + j);
            hi[8 * l + j] = (uint8_t)(l * k + 8 + j);
            if (8 + j < k)
                p->hi_mask |= 1ull << (8 * l + j);
        }
    p->lo_idx = _mm512_loadu_si512(lo);
    p->hi_idx = _mm512_loadu_si512(hi);
    p->pairs = _mm512_set1_epi16((short)(1 | (1 << width) << 8)); /* bytes 1, 2^width */
    p->quads = _mm512_set1_epi32(1 | (1 << 2 * width) << 16);    /* int16 1, 2^(2 width) */
}

/* Word of codes[0..k): code j at bit width * j (pext gathers the codes' low bits from their
 * bytes, pdep spreads them into the lanes); reads up to 32 bytes. */
AVX512 static inline uint64_t pack_word(const uint8_t *codes, const packer *p) {
    uint64_t acc = 0;
    for (int c = 0; c * 8 < p->k; c++) {
        uint64_t v;
        memcpy(&v, codes + 8 * c, 8);
        int left = p->k - 8 * c;
        uint64_t mask = left >= 8 ? p->bytemask : p->bytemask & ((1ull << (8 * left)) - 1);
        acc |= _pext_u64(v, mask) << (8 * p->bits * c);
    }
    return _pdep_u64(acc, p->lanemask);
}

/* Eight codes (bytes of each qword) at bits 0, width, ..., 7 width: multiply-adds join pairs,
 * then pairs of pairs, and a shift and a blend the two halves. */
AVX512 static inline __m512i join8(__m512i bytes, const packer *p) {
    __m512i quad = _mm512_madd_epi16(_mm512_maddubs_epi16(bytes, p->pairs), p->quads);
    __m512i high = _mm512_srli_epi64(quad, 32 - 4 * p->width);
    return _mm512_ternarylogic_epi64(_mm512_set1_epi64((1ll << 4 * p->width) - 1), quad, high, 0xca);
}

/* Words of codes[0..8 k words) (reads 128 bytes from codes): words[0..count). */
AVX512 static int64_t pack_words(const uint8_t *codes, int64_t count, const packer *p, void *words, int as_int) {
    int64_t w = 0;
    if (p->vector)
        for (; w + 8 <= count; w += 8) {
            const uint8_t *src = codes + w * p->k;
            __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 64);
            __m512i lo = join8(_mm512_permutex2var_epi8(a, p->lo_idx, b), p);
            __m512i hi = join8(_mm512_maskz_permutex2var_epi8(p->hi_mask, a, p->hi_idx, b), p);
            __m512i word = _mm512_or_si512(lo, _mm512_slli_epi64(hi, 8 * p->width));
            if (as_int)
                _mm512_storeu_si512((uint64_t *)words + w, word);
            else
                _mm512_storeu_pd((double *)words + w, _mm512_cvtepu64_pd(word));
        }
    for (; w < count; w++) {
        uint64_t word = pack_word(codes + w * p->k, p);
        if (as_int)
            ((uint64_t *)words)[w] = word;
        else
            ((double *)words)[w] = (double)word;
    }
    return count;
}

/* decoded[i] = table[codes[i]], or minuend[i] - that: 16 at a time by a permute of the table
 * for codes of up to 4 bits. */
AVX512 static void own_share(const uint8_t *codes, int64_t m, const float *table, int bits, const float *minuend,
                             float *decoded) {
    int64_t i = 0;
    if (bits <= 4) {
        __m512 tab = _mm512_loadu_ps(table); /* 16 entries: unused ones never indexed */
        for (; i + 16 <= m; i += 16) {
            __m512 own = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i))), tab);
            _mm512_storeu_ps(decoded + i, minuend ? _mm512_sub_ps(_mm512_loadu_ps(minuend + i), own) : own);
        }
    }
    for (; i < m; i++)
        decoded[i] = minuend ? minuend[i] - table[codes[i]] : table[codes[i]];
}

AVX512 void thc_pack_avx512(const float *y, int64_t n, double inv_scale, int levels, int width, int k, int bounded,
                            uint64_t *state, const float *minuend, float *decoded, void *words, int as_int) {
    if (state)
        pthread_once(&jump_once, make_jumps);
    static __thread uint8_t codes[THC_BLOCK + 256];
    uint8_t byte4[64];
    for (int i = 0; i < 64; i++)
        byte4[i] = (uint8_t)(8 * i + 4);
    const code_consts c = {_mm512_set1_pd(inv_scale), _mm512_set1_pd(1.0), _mm512_set1_pd(levels / 2.0),
                           _mm512_set1_pd(levels), _mm512_set1_pd(1.0 / 4294967296.0),
                           _mm512_set1_ps((float)inv_scale), _mm512_set1_pd(levels / 2.0 * 4294967296.0),
                           _mm512_set1_pd(2147483648.0), _mm512_loadu_si512(byte4)};
    int bits = 0;
    while ((1 << bits) <= levels)
        bits++;
    packer p;
    make_packer(&p, k, width, bits);
    float table[256] = {0};
    if (decoded)
        for (int q = 0; q <= levels; q++)
            table[q] = thc_decoded(q, 1.0 / inv_scale, levels);
    /* 16 streams where y fits in half the last level cache: from memory, 16 lanes' reads (each
     * 2^(LOG_STREAM + 2) bytes from the next) took up to 1.7x as long as 8 lanes' (8M elements,
     * a 32 MiB cache), while 4M took 0.94x and 1M 0.9x */
    const int wide = 2 * n * (int64_t)sizeof(float) <= thc_cache_bytes();
    int64_t w = 0, held = 0; /* words written; codes[0..held) not packed yet (held < k) */
    for (int64_t done = 0; done < n;) {
        int64_t m = n - done < THC_BLOCK ? n - done : THC_BLOCK;
        uint8_t *dst = codes + held;
        int64_t coded = 0; /* a whole block, or the tail in blocks of halving lanes */
        if (!state) {
            coded = m - m % 16;
            nearest_codes(y + done, coded, bounded, &c, dst);
        }
        for (int log_lane = LOG_STREAM; state && log_lane >= 3; log_lane--)
            if (m - coded >= 16 << log_lane) {
                (log_lane > 3 && wide ? (bounded ? drawn_block2_bounded : drawn_block2)
                                      : (bounded ? drawn_block_bounded : drawn_block))(y + done + coded, log_lane, state,
                                                                                       &c, dst + coded);
                coded += 16 << log_lane;
            }
        thc_codes_scalar(y + done + coded, m - coded, inv_scale, levels, state, dst + coded); /* < 128 left */
        if (decoded)
            own_share(dst, m, table, bits, minuend ? minuend + done : NULL, decoded + done);
        done += m;
        int64_t avail = held + m;
        memset(codes + avail, 0, 192); /* the last word's missing codes, and what pack_words over-reads */
        int64_t count = done == n ? (avail + k - 1) / k : avail / k;
        w += pack_words(codes, count, &p, as_int ? (void *)((uint64_t *)words + w) : (void *)((double *)words + w),
                        as_int);
        held = done == n ? 0 : avail - count * k;
        memmove(codes, codes + count * k, held);
    }
}

