#ifndef BPS_GC_BITSTREAM_H
#define BPS_GC_BITSTREAM_H
#include "common.h"

/* ---------------------------------------------------------------- bit streams */

/* The codecs.md stream is a sequence of W words (little-endian), each filled MSB first. The
 * kernels work on the same bits as a big-endian byte stream, which allows branch-free 8-byte
 * loads and stores at any bit offset, and byteswap each word at the boundary. */
static inline uint64_t load_be64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return __builtin_bswap64(v); }
static inline void store_be64(uint8_t *p, uint64_t v) { v = __builtin_bswap64(v); memcpy(p, &v, 8); }

static inline void swap_words(uint8_t *p, int64_t nwords, int wbits) {
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

#endif
