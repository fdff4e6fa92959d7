/* thc's AVX-512 decoding (kernels/thc.c dispatches here when the CPU has it): each summed
 * lane looked up in a table of its 2^width values, which thc.c computes with its formula, so
 * the floats are thc.c's bit for bit. */
#include "common.h"
#include "thc.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")))

AVX512 void convert_words(const void *words, int64_t w0, int64_t w1, uint64_t *out) {
    const double *f = (const double *)words;
    for (int64_t w = w0; w < w1; w++)
        out[w - w0] = (uint64_t)f[w];
}

/* Elements [0, n) (n a multiple of 16) of the summed words u (16 words past the last one
 * readable) looked up in table (32 x pairs floats): the 16 elements of vector v start at lane
 * (16 v) % k, and the pattern repeats every `period` vectors, which move `stride` words; each
 * element's 4 bytes from its byte on (a byte permute of 16 words) shifted by its bit within the
 * byte hold its lane in the low bits, which are all the table permute reads (the table repeats
 * every 2^width entries below 32). */
AVX512 static void unpack_table(const uint64_t *u, int64_t n, int width, int k, const float *table, int pairs,
                                float *out) {
    int period = k, stride;
    while (period % 2 == 0 && period > 1 && (16 * period / 2) % k == 0)
        period /= 2;
    stride = 16 * period / k;
    __m512i idx[64], shift[64];
    int base[64];
    for (int v = 0; v < period; v++) {
        uint8_t b[64];
        int32_t sh[16];
        base[v] = 16 * v / k;
        for (int m = 0; m < 16; m++) {
            int e = 16 * v + m, bit = 64 * (e / k - base[v]) + width * (e % k);
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
    const __m512i top = _mm512_set1_epi32(pairs - 1);
    int64_t e = 0;
    for (const uint64_t *w = u; e < n; w += stride)
        for (int v = 0; v < period && e < n; v++, e += 16) {
            const uint64_t *src = w + base[v];
            __m512i q = _mm512_permutex2var_epi8(_mm512_loadu_si512(src), idx[v], _mm512_loadu_si512(src + 8));
            q = _mm512_srlv_epi32(q, shift[v]);
            __m512 x = _mm512_permutex2var_ps(tab[0], q, tab[1]);
            if (pairs > 1) {
                __m512i which = _mm512_and_si512(_mm512_srli_epi32(q, 5), top);
                for (int t = 1; t < pairs; t++) {
                    __mmask16 sel = _mm512_cmpeq_epi32_mask(which, _mm512_set1_epi32(t));
                    x = _mm512_mask_mov_ps(x, sel, _mm512_permutex2var_ps(tab[2 * t], q, tab[2 * t + 1]));
                }
            }
            _mm512_storeu_ps(out + e, x);
        }
}

/* 16 elements of an even k (unpack_even) at out from the (at most 3) words at src: the first
 * word broadcast to every pair's qword, the second and third over those of the pairs in them
 * (loads, not permutes: the permutes are the table's). */
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi"))) void
even16(const void *src, int as_int, int pairs, __mmask8 second, __mmask8 third, __m512i field, const __m512 *tab,
       float *out) {
    const int64_t *s = (const int64_t *)src;
    __m512i w = _mm512_mask_set1_epi64(_mm512_mask_set1_epi64(_mm512_set1_epi64(s[0]), second, s[1]), third, s[2]);
    if (!as_int)
        w = _mm512_cvttpd_epu64(_mm512_castsi512_pd(w));
    __m512i q = _mm512_multishift_epi64_epi8(field, w);
    __m512 x = _mm512_permutex2var_ps(tab[0], q, tab[1]);
    if (pairs > 1) {
        __m512i which = _mm512_and_si512(_mm512_srli_epi32(q, 5), _mm512_set1_epi32(pairs - 1));
        for (int t = 1; t < pairs; t++) {
            __mmask16 sel = _mm512_cmpeq_epi32_mask(which, _mm512_set1_epi32(t));
            x = _mm512_mask_mov_ps(x, sel, _mm512_permutex2var_ps(tab[2 * t], q, tab[2 * t + 1]));
        }
    }
    _mm512_storeu_ps(out, x);
}

/* Whole periods of PERIOD (a constant: the compiler unrolls them, masks and fields in
 * registers; a third faster than a loop over the period) from out + e on. */
#define EVEN_PERIODS(PERIOD, AS_INT, PAIRS)                                                           \
    for (; e + 16 * (PERIOD) <= n; e += 16 * (PERIOD), w += stride) {                                 \
        __builtin_prefetch((const char *)w + PF_AHEAD / 4, 0, 3); /* a period reads <= 8 words */     \
        _Pragma("GCC unroll 16") for (int v = 0; v < (PERIOD); v++) {                                 \
            __builtin_prefetch(out + e + 16 * v + PF_AHEAD / 4, 1, 3); /* a vector writes a line */   \
            even16(w + base[v], AS_INT, PAIRS, second[v], third[v], field[v], tab, out + e + 16 * v); \
        }                                                                                             \
    }

/* The loop of unpack_even for one kind of word and table (constants, so each is its own loop):
 * whole periods of vectors (k = 10, 12, 14 and powers of two: periods of 5, 3, 7 and 1),
 * then the vectors left. */
#define EVEN_LOOP(AS_INT, PAIRS)                                                                      \
    do {                                                                                              \
        const uint64_t *w = (const uint64_t *)words;                                                  \
        int64_t e = 0;                                                                                \
        switch (period) {                                                                             \
        case 1: EVEN_PERIODS(1, AS_INT, PAIRS); break;                                                \
        case 3: EVEN_PERIODS(3, AS_INT, PAIRS); break;                                                \
        case 5: EVEN_PERIODS(5, AS_INT, PAIRS); break;                                                \
        case 7: EVEN_PERIODS(7, AS_INT, PAIRS); break;                                                \
        default: EVEN_PERIODS(period, AS_INT, PAIRS);                                                 \
        }                                                                                             \
        for (int v = 0; e < n; v++, e += 16)                                                          \
            even16(w + base[v], AS_INT, PAIRS, second[v], third[v], field[v], tab, out + e);          \
    } while (0)

/* unpack_table for an even k >= 8: the two elements of a dword pair (an even one and the next)
 * share a word, so with each pair's word in its qword (even16) a multishift takes each
 * element's 8 bits from its lane's first bit (float64 words converted as they are loaded,
 * already checked). */
AVX512 static void unpack_even(const void *words, int as_int, int64_t n, int width, int k, const float *table,
                               int pairs, float *out) {
    int period = k, stride;
    while (period % 2 == 0 && period > 1 && (16 * period / 2) % k == 0)
        period /= 2;
    stride = 16 * period / k;
    __m512i field[64];
    __mmask8 second[64], third[64];
    int base[64];
    for (int v = 0; v < period; v++) {
        uint8_t f[64] = {0};
        base[v] = 16 * v / k;
        second[v] = third[v] = 0;
        for (int m = 0; m < 16; m++) {
            int e = 16 * v + m, word = e / k - base[v]; /* 0, 1 or 2 */
            second[v] |= (__mmask8)((word >= 1) << (m / 2));
            third[v] |= (__mmask8)((word >= 2) << (m / 2));
            f[8 * (m / 2) + 4 * (m % 2)] = (uint8_t)(width * (e % k));
        }
        field[v] = _mm512_loadu_si512(f);
    }
    __m512 tab[8];
    for (int t = 0; t < 2 * pairs; t++)
        tab[t] = _mm512_loadu_ps(table + 16 * t);
    if (as_int && pairs == 1)
        EVEN_LOOP(1, 1);
    else if (pairs == 1)
        EVEN_LOOP(0, 1);
    else if (as_int)
        EVEN_LOOP(1, pairs);
    else
        EVEN_LOOP(0, pairs);
}

static int word_ok(double v) { return v >= 0.0 && v < 9007199254740992.0 && v == floor(v); }

/* 0 when every float64 word is an integer in [0, 2^53), else ERR_CODE. Eight words at a time
 * pass when their bits are below 2^53's (a positive double below 2^53; negative ones have the
 * sign bit) and each equals its floor; eight that do not are checked one by one (-0.0, which
 * thc.c accepts, fails the first test). */
AVX512 int64_t thc_check_words_avx512(const double *w, int64_t nwords) {
    const __m512i limit = _mm512_set1_epi64(0x4340000000000000ll); /* 2^53 */
    int64_t i = 0;
    for (; i + 8 <= nwords; i += 8) {
        __m512d v = _mm512_loadu_pd(w + i);
        __mmask8 ok = _mm512_mask_cmp_pd_mask(_mm512_cmplt_epu64_mask(_mm512_castpd_si512(v), limit), v,
                                              _mm512_roundscale_pd(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                              _CMP_EQ_OQ);
        if (ok != 0xff)
            for (int j = 0; j < 8; j++)
                if (!word_ok(w[i + j]))
                    return ERR_CODE;
    }
    for (; i < nwords; i++)
        if (!word_ok(w[i]))
            return ERR_CODE;
    return 0;
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
    if (k % 2 == 0 && k >= 8) {
        unpack_even(words, as_int, limit, width, k, tab, pairs, out);
        return limit;
    }
    if (as_int) {
        unpack_table((const uint64_t *)words, limit, width, k, tab, pairs, out);
        return limit;
    }
    enum { SLICE = 2048 }; /* float64 words converted a slice at a time */
    static __thread uint64_t buf[SLICE + 32];
    int64_t per = (int64_t)SLICE * k; /* a slice starts at lane 0 of a word, and of a period */
    int64_t done = 0;
    while (done < limit) {
        int64_t m = limit - done < per ? limit - done : per, w0 = done / k;
        int64_t w1 = (done + m) / k + 17 < nwords ? (done + m) / k + 17 : nwords;
        convert_words(words, w0, w1, buf);
        unpack_table(buf, m, width, k, tab, pairs, out + done);
        done += m;
    }
    return done;
}
