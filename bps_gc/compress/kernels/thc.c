/* thc (docs/codecs.md, compress/thc.py): b-bit codes against a shared power-of-two scale,
 * packed k to a word in lanes of `width` bits, and the decoding of their sums. A word is a
 * float64 holding an integer below 2^53 (the parameter server's), or with `as_int` an int64
 * read unsigned (torch.distributed's, whose sums wrap modulo 2^64). */
#include <stdio.h>
#include <unistd.h>

#include "common.h"
#include "thc.h"

/* max |x[i] (+ add[i])| over n float32, NaN when one is NaN or infinite (np.max(np.abs(.))'s
 * exponent bin); with `add`, sum[i] = x[i] + add[i] (error feedback's input). The absolute
 * values' bit patterns order like the values, so the max is an integer max. */
EXPORT __attribute__((target_clones("avx512f", "avx2", "default"))) double thc_peak_f32(
    const float *x, const float *add, float *sum, int64_t n) {
    uint32_t top = 0;
    if (add) {
        for (int64_t i = 0; i < n; i++) {
            float v = x[i] + add[i];
            uint32_t b;
            sum[i] = v;
            memcpy(&b, &v, 4);
            b &= 0x7fffffffu;
            top = b > top ? b : top;
        }
    } else {
        const uint32_t *bits = (const uint32_t *)x;
        for (int64_t i = 0; i < n; i++) {
            uint32_t b = bits[i] & 0x7fffffffu;
            top = b > top ? b : top;
        }
    }
    if (top >= 0x7f800000u)
        return NAN;
    float peak;
    memcpy(&peak, &top, 4);
    return peak;
}

void thc_codes_scalar(const float *y, int64_t m, double inv_scale, int levels, uint64_t *state, uint8_t *codes) {
    const double half = levels / 2.0;
    for (int64_t i = 0; i < m; i += 2) {
        uint64_t bits = state ? xs_next(state) : 0;
        for (int h = 0; h < 2 && i + h < m; h++) {
            double r = state ? (double)(uint32_t)(bits >> (32 - 32 * h)) * (1.0 / 4294967296.0) : 0.5;
            codes[i + h] = (uint8_t)thc_code(y[i + h], inv_scale, half, r, levels);
        }
    }
}

/* y: n float32 (the rotated or plain input); bounded: every |y| * inv_scale <= 1 (lets the
 * AVX-512 path skip the clamps). state: xorshift128+ for stochastic rounding (32 random bits
 * per element, two per output, high half first), or NULL for the nearest. decoded (or NULL):
 * each code decoded alone, scale * (2 q / levels - 1) as float32 (error feedback's own share),
 * or with minuend (n float32) minuend - that (the residual, in one pass).
 * words: ceil(n / k) float64 (or int64), code j of a word at bit width * j. */
EXPORT HOT void thc_pack_f32(const float *y, int64_t n, double inv_scale, int levels, int width, int k,
                             int bounded, uint64_t *state, const float *minuend, float *decoded, void *words,
                             int as_int) {
    if (thc_has_avx512()) {
        thc_pack_avx512(y, n, inv_scale, levels, width, k, bounded, state, minuend, decoded, words, as_int);
        return;
    }
    uint64_t st[2] = {state ? state[0] : 0, state ? state[1] : 0};
    const double half = levels / 2.0, scale = 1.0 / inv_scale;
    uint64_t bits = 0;
    int have = 0;
    int64_t nwords = (n + k - 1) / k;
    for (int64_t w = 0; w < nwords; w++) {
        uint64_t word = 0;
        int64_t base = w * k;
        for (int j = 0; j < k && base + j < n; j++) {
            double r = 0.5;
            if (state) {
                if (!have) {
                    bits = xs_next(st);
                    have = 2;
                }
                r = (double)(uint32_t)(bits >> 32) * (1.0 / 4294967296.0);
                bits <<= 32;
                have--;
            }
            int64_t q = thc_code(y[base + j], inv_scale, half, r, levels);
            if (decoded) {
                float own = thc_decoded(q, scale, levels);
                decoded[base + j] = minuend ? minuend[base + j] - own : own;
            }
            word |= (uint64_t)q << (width * j);
        }
        if (as_int)
            ((uint64_t *)words)[w] = word;
        else
            ((double *)words)[w] = (double)word; /* below 2^53: exact */
    }
    if (state) {
        state[0] = st[0];
        state[1] = st[1];
    }
}

/* out[i] = scale * (2 Q_i / levels - summands) in float64, stored as float32, for the n lane
 * sums Q_i of `nwords` summed words; for float64 words, ERR_CODE when one is not an integer in
 * [0, 2^53) (a lane overflowed, or not thc's sums), before anything is written. Lanes of up to
 * 16 bits are looked up in a table of the formula's 2^width values. */
EXPORT HOT int64_t thc_unpack_f64(const void *words, int64_t nwords, int64_t n, int width, int k,
                                  double scale, int levels, double summands, float *out, int as_int) {
    if (nwords * k < n)
        return ERR_TRUNCATED;
    const uint64_t mask = (1ull << width) - 1; /* width <= 53 */
    const double *floats = (const double *)words;
    if (!as_int && thc_has_avx512() && thc_check_words_avx512(floats, nwords) < 0)
        return ERR_CODE;
    for (int64_t w = 0; w < nwords && !as_int && !thc_has_avx512(); w++) {
        double v = floats[w];
        if (!(v >= 0.0 && v < 9007199254740992.0) || v != floor(v))
            return ERR_CODE;
    }
    float small[128] = {0}, *table = width <= 7 ? small : NULL;
    if (width > 7 && width <= 16 && !(table = malloc(sizeof(float) << width)))
        return ERR_NOMEM;
    if (table)
        for (uint64_t q = 0; q <= mask; q++)
            table[q] = (float)(scale * (2.0 * (double)q / levels - summands));
    int64_t done = table && thc_has_avx512() ? thc_unpack_avx512(words, nwords, n, width, k, table, out, as_int) : 0;
    for (int64_t w = done / k; w < nwords; w++) {
        uint64_t word = as_int ? ((const uint64_t *)words)[w] : (uint64_t)floats[w];
        int64_t base = w * k;
        for (int j = (int)(done > base ? done - base : 0); j < k && base + j < n; j++) {
            uint64_t q = (word >> (width * j)) & mask;
            out[base + j] = table ? table[q] : (float)(scale * (2.0 * (double)q / levels - summands));
        }
    }
    if (table && table != small)
        free(table);
    return n;
}

/* Bytes of the last level cache this core sees, read once: sysfs's index3 (as lscpu reads it;
 * in a VM sysconf can report the host's whole L3, 12 times one core's share on an EPYC),
 * else sysconf's, else 32 MiB. Every thread computes the same value. */
int64_t thc_cache_bytes(void) {
    static int64_t bytes = 0;
    int64_t b = __atomic_load_n(&bytes, __ATOMIC_RELAXED);
    if (b)
        return b;
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    long size = 0;
    char unit = 0;
    if (f) {
        if (fscanf(f, "%ld%c", &size, &unit) < 1)
            size = 0;
        fclose(f);
    }
    b = size * (unit == 'K' ? 1024 : unit == 'M' ? 1 << 20 : 1);
    if (b <= 0)
        b = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (b <= 0)
        b = 32 << 20;
    __atomic_store_n(&bytes, b, __ATOMIC_RELAXED);
    return b;
}

/* The rotation, in place: each of `rows` blocks of `block` (a power of two) float32 values
 * becomes H D x (inverse 0) or D H x (inverse 1), H the Walsh-Hadamard butterflies scaled by
 * float32(1 / sqrt(block)) at the end, D the +-1 `signs`: the same float32 operations, in the
 * same order, as compress/thc.py's ``hadamard``. */
EXPORT HOT void thc_rotate_f32(float *x, int64_t rows, int64_t block, const float *signs, int inverse,
                               float norm) {
    for (int64_t r = 0; r < rows; r++) {
        float *b = x + r * block;
        if (!inverse)
            for (int64_t i = 0; i < block; i++)
                b[i] *= signs[i];
        for (int64_t h = 1; h < block; h *= 2)
            for (int64_t g = 0; g < block; g += 2 * h)
                for (int64_t i = g; i < g + h; i++) {
                    float a = b[i], c = b[i + h];
                    b[i] = a + c;
                    b[i + h] = a - c;
                }
        for (int64_t i = 0; i < block; i++)
            b[i] = inverse ? b[i] * norm * signs[i] : b[i] * norm;
    }
}
