/* thc's AVX-512 decoding (kernels/thc.c dispatches here when the CPU has it): each summed
 * lane looked up in a table of its 2^width values, which thc.c computes with its formula, so
 * the floats are thc.c's bit for bit. */
#include "common.h"
#include "thc.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")))


#define INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")))

/* The table's values of 16 lanes (each in the low bits of q, garbage above): a permute reads
 * the low 5 bits; lanes of 6 and 7 bits choose between 32-entry permutes by bits 5 and 6. */
INLINE __m512 lookup16(__m512i q, int pairs, const __m512 *tab) {
    __m512 x = _mm512_permutex2var_ps(tab[0], q, tab[1]);
    if (pairs > 1) {
        __mmask16 bit5 = _mm512_test_epi32_mask(q, _mm512_set1_epi32(32));
        x = _mm512_mask_mov_ps(x, bit5, _mm512_permutex2var_ps(tab[2], q, tab[3]));
        if (pairs > 2) {
            __m512 y = _mm512_mask_mov_ps(_mm512_permutex2var_ps(tab[4], q, tab[5]), bit5,
                                          _mm512_permutex2var_ps(tab[6], q, tab[7]));
            x = _mm512_mask_mov_ps(x, _mm512_test_epi32_mask(q, _mm512_set1_epi32(64)), y);
        }
    }
    return x;
}

/* A vector of out: streamed past the caches (nt, a 64-byte aligned out larger than the last
 * level cache, which it would only evict: no line read for ownership), or stored. */
INLINE void put16(float *out, __m512 v, int nt) {
    if (nt)
        _mm512_stream_ps(out, v);
    else
        _mm512_storeu_ps(out, v);
}

/* 16 elements of any k (unpack_table) at out from the 16 words at src: each element's 4 bytes
 * from its lane's byte on (a byte permute of the 16 words), shifted by its bit in the byte. */
INLINE void any16(const uint64_t *src, int as_int, int pairs, __m512i idx, __m512i shift, const __m512 *tab,
                  float *out, int nt) {
    __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 8);
    if (!as_int) /* float64 words (checked) */
        a = _mm512_cvttpd_epu64(_mm512_castsi512_pd(a)), b = _mm512_cvttpd_epu64(_mm512_castsi512_pd(b));
    __m512i q = _mm512_permutex2var_epi8(a, idx, b);
    put16(out, lookup16(_mm512_srlv_epi32(q, shift), pairs, tab), nt);
}

/* Whole periods of PERIOD vectors from out + e on, PERIOD a constant where it is a common one
 * (the compiler unrolls them, their patterns in registers: a third faster than a loop over
 * the period), then the vectors left. BODY(src, v, out, A, P) decodes vector v of a period
 * (A: integer words, P: pairs; constants where SPECIALIZED makes them so). CASES(BODY, A, P):
 * the switch's cases of the common periods. */
#define PERIODS(PERIOD, BODY, A, P)                                                                   \
    for (; e + 16 * (PERIOD) <= n; e += 16 * (PERIOD), w += stride) {                                 \
        __builtin_prefetch((const char *)w + PF_AHEAD / 4, 0, 3); /* a period reads <= 16 words */    \
        _Pragma("GCC unroll 16") for (int v = 0; v < (PERIOD); v++) {                                 \
            if (!nt) /* a vector writes a line; streamed ones are never read */                        \
                __builtin_prefetch(out + e + 16 * v + PF_AHEAD / 4, 1, 3);                            \
            BODY(w + base[v], v, out + e + 16 * v, A, P);                                             \
        }                                                                                             \
    }
#define ALL_PERIODS(BODY, CASES, A, P)                                                                \
    do {                                                                                              \
        const uint64_t *w = u;                                                                        \
        int64_t e = 0;                                                                                \
        switch (period) {                                                                             \
        CASES(BODY, A, P)                                                                             \
        default: PERIODS(period, BODY, A, P);                                                         \
        }                                                                                             \
        for (int v = 0; e < n; v++, e += 16)                                                          \
            BODY(w + base[v], v, out + e, A, P);                                                      \
    } while (0)
/* The loops once per word type and pair count that is common: integer words or float64, one
 * pair (a constant the compiler folds) or several. */
#define SPECIALIZED(BODY, CASES)                                                                      \
    do {                                                                                              \
        if (as_int && pairs == 1)                                                                     \
            ALL_PERIODS(BODY, CASES, 1, 1);                                                           \
        else if (pairs == 1)                                                                          \
            ALL_PERIODS(BODY, CASES, 0, 1);                                                           \
        else if (!as_int)                                                                             \
            ALL_PERIODS(BODY, CASES, 0, pairs);                                                       \
        else                                                                                          \
            ALL_PERIODS(BODY, CASES, 1, pairs);                                                       \
    } while (0)

/* The pattern of 16 elements starting at lane (16 v) % k of word base[v] repeats every
 * `period` vectors, which move `stride` words. */
static int period_of(int k, int *stride) {
    int period = k;
    while (period % 2 == 0 && (16 * period / 2) % k == 0)
        period /= 2;
    *stride = 16 * period / k;
    return period;
}

/* Elements [e0, e0 + n) (n a multiple of 16, e0 < 16) of the summed words u (16 words past the
 * last one readable) looked up in table (32 x pairs floats; below 32 entries it repeats every
 * 2^width), at out[0, n). */
AVX512 static void unpack_table(const uint64_t *u, int as_int, int e0, int64_t n, int width, int k, const float *table,
                                int pairs, float *out, int nt) {
    int stride, period = period_of(k, &stride);
    __m512i idx[64], shift[64];
    int base[64];
    for (int v = 0; v < period; v++) {
        uint8_t b[64];
        int32_t sh[16];
        base[v] = (e0 + 16 * v) / k;
        for (int m = 0; m < 16; m++) {
            int e = e0 + 16 * v + m, bit = 64 * (e / k - base[v]) + width * (e % k);
            for (int i = 0; i < 4; i++)
                b[4 * m + i] = (uint8_t)(bit / 8 + i);
            sh[m] = bit % 8;
        }
        idx[v] = _mm512_loadu_si512(b);
        shift[v] = _mm512_loadu_si512(sh);
    }
    __m512 tab[8];
    for (int t = 0; t < 2 * pairs; t++)
        tab[t] = _mm512_loadu_ps(table + 16 * t);
#define ANY(SRC, V, OUT, A, P) any16(SRC, A, P, idx[V], shift[V], tab, OUT, nt)
    /* k = 7, 9, 13: 5 to 8 summands of 4 bits, one in float64 words */
#define ANY_CASES(BODY, A, P) \
    case 7: PERIODS(7, BODY, A, P) break; case 9: PERIODS(9, BODY, A, P) break; case 13: PERIODS(13, BODY, A, P) break;
    SPECIALIZED(ANY, ANY_CASES);
#undef ANY_CASES
#undef ANY
}

/* 16 elements of an even k (unpack_even) at out from the (at most 3) words at src: the first
 * word broadcast to every pair's qword, the second and third over those of the pairs in them
 * (loads, not permutes: the permutes are the table's), converted from float64 (checked). */
INLINE void even16(const uint64_t *src, int as_int, int pairs, __mmask8 second, __mmask8 third, __m512i field,
                   const __m512 *tab, float *out, int nt) {
    const int64_t *s = (const int64_t *)src;
    __m512i w = _mm512_mask_set1_epi64(_mm512_mask_set1_epi64(_mm512_set1_epi64(s[0]), second, s[1]), third, s[2]);
    if (!as_int)
        w = _mm512_cvttpd_epu64(_mm512_castsi512_pd(w));
    put16(out, lookup16(_mm512_multishift_epi64_epi8(field, w), pairs, tab), nt);
}

/* unpack_table for an even k >= 8 and an even e0: the two elements of a dword pair (an even
 * one and the next) share a word, so with each pair's word in its qword (even16) a multishift
 * takes each element's 8 bits from its lane's first bit. */
AVX512 static void unpack_even(const uint64_t *u, int as_int, int e0, int64_t n, int width, int k, const float *table,
                               int pairs, float *out, int nt) {
    int stride, period = period_of(k, &stride);
    __m512i field[64];
    __mmask8 second[64], third[64];
    int base[64];
    for (int v = 0; v < period; v++) {
        uint8_t f[64] = {0};
        base[v] = (e0 + 16 * v) / k;
        second[v] = third[v] = 0;
        for (int m = 0; m < 16; m++) {
            int e = e0 + 16 * v + m, word = e / k - base[v]; /* 0, 1 or 2 */
            second[v] |= (__mmask8)((word >= 1) << (m / 2));
            third[v] |= (__mmask8)((word >= 2) << (m / 2));
            f[8 * (m / 2) + 4 * (m % 2)] = (uint8_t)(width * (e % k));
        }
        field[v] = _mm512_loadu_si512(f);
    }
    __m512 tab[8];
    for (int t = 0; t < 2 * pairs; t++)
        tab[t] = _mm512_loadu_ps(table + 16 * t);
    /* k = 10, 12, 14 and powers of two: periods of 5, 3, 7 and 1 */
#define EVEN(SRC, V, OUT, A, P) even16(SRC, A, P, second[V], third[V], field[V], tab, OUT, nt)
#define EVEN_CASES(BODY, A, P) \
    case 1: PERIODS(1, BODY, A, P) break; case 3: PERIODS(3, BODY, A, P) break; \
    case 5: PERIODS(5, BODY, A, P) break; case 7: PERIODS(7, BODY, A, P) break;
    SPECIALIZED(EVEN, EVEN_CASES);
#undef EVEN_CASES
#undef EVEN
}

static int word_ok(double v) { return v >= 0.0 && v < 9007199254740992.0 && v == floor(v); }

/* 0 when every float64 word is an integer in [0, 2^53), else ERR_CODE. Words pass when their
 * bits are below 2^53's (a positive double below 2^53; negative ones, NaN and inf have bits
 * above) and v - floor(v) is +0.0, 32 at a time from the first 64-byte line on (the lines
 * prefetched: the words are often out of the first two cache levels): bits max-ed and
 * fractions or-ed in vectors, no mask per vector (that took twice the instructions; vreducepd,
 * v - floor(v) in one, is slower here and gives -0.0). 32 that do not pass are checked one by
 * one (-0.0, which thc.c accepts, fails the first test). */
AVX512 int64_t thc_check_words_avx512(const double *w, int64_t nwords) {
    const __m512i limit = _mm512_set1_epi64(0x4340000000000000ll); /* 2^53 */
    int64_t i = 0;
    for (; i < nwords && (uintptr_t)(w + i) % 64; i++) /* then whole lines: no load splits two */
        if (!word_ok(w[i]))
            return ERR_CODE;
    for (; i + 32 <= nwords; i += 32) {
        PREFETCH_AHEAD(w + i, 256, 0);
        __m512i top = _mm512_setzero_si512(), frac = _mm512_setzero_si512();
        for (int j = 0; j < 32; j += 8) {
            __m512d v = _mm512_load_pd(w + i + j);
            top = _mm512_max_epu64(top, _mm512_castpd_si512(v));
            frac = _mm512_or_si512(frac, _mm512_castpd_si512(_mm512_sub_pd(
                                       v, _mm512_roundscale_pd(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC))));
        }
        if (_mm512_cmpge_epu64_mask(top, limit) | _mm512_test_epi64_mask(frac, frac))
            for (int j = 0; j < 32; j++)
                if (!word_ok(w[i + j]))
                    return ERR_CODE;
    }
    for (; i < nwords; i++)
        if (!word_ok(w[i]))
            return ERR_CODE;
    return 0;
}

/* Outputs of more bytes than this are streamed: the last level cache's size until set. */
static int64_t stream_above = 0;

/* Set the size above which outputs are streamed (bytes <= 0: the last level cache's again; the
 * tests lower it to cover streaming on any machine); returns the one before. */
EXPORT int64_t thc_stream_above(int64_t bytes) {
    int64_t before = __atomic_load_n(&stream_above, __ATOMIC_RELAXED);
    __atomic_store_n(&stream_above, bytes > 0 ? bytes : thc_cache_bytes(), __ATOMIC_RELAXED);
    return before ? before : thc_cache_bytes();
}

/* thc_unpack_f64 for lanes of width <= 7 (a table of at most 128 values, 2^width of them
 * given): returns the elements it decoded (a prefix; thc.c decodes the rest). float64 words
 * must have been checked to be integers below 2^53. */
AVX512 int64_t thc_unpack_avx512(const void *words, int64_t nwords, int64_t n, int width, int k, const float *table,
                                 float *out, int as_int) {
    if (width > 7 || k > 64)
        return 0;
    int pairs = width <= 5 ? 1 : 1 << (width - 5);
    float tab[128];
    for (int i = 0; i < 32 * pairs; i++)
        tab[i] = table[i & ((1 << width) - 1)];
    int64_t safe = nwords - 17; /* whole vectors whose words and the 16 after are in the buffer */
    if (safe <= 0)
        return 0;
    int64_t limit = safe * k < n ? safe * k : n;
    limit -= limit % 16;
    /* An out larger than the caches goes to memory anyway: streamed, its lines are not read
     * first. Streamed vectors start at a 64-byte line, so the e0 elements before it (numpy's
     * large arrays start 16 bytes into one) are decoded here one by one. */
    int nt = (uintptr_t)out % 4 == 0 && limit * (int64_t)sizeof(float) >
             (__atomic_load_n(&stream_above, __ATOMIC_RELAXED) ?: thc_cache_bytes());
    int e0 = nt ? (int)((64 - (uintptr_t)out % 64) % 64 / 4) : 0;
    for (int e = 0; e < e0; e++) {
        uint64_t word = as_int ? ((const uint64_t *)words)[e / k] : (uint64_t)((const double *)words)[e / k];
        out[e] = tab[(word >> (width * (e % k))) & ((1u << width) - 1)];
    }
    limit = e0 + (limit - e0) / 16 * 16;
    (k % 2 == 0 && k >= 8 && e0 % 2 == 0 ? unpack_even : unpack_table)(words, as_int, e0, limit - e0, width, k, tab,
                                                                      pairs, out + e0, nt);
    if (nt)
        _mm_sfence(); /* the streamed stores ordered before anything after the call */
    return limit;
}

