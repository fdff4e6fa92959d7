"""thc: summable b-bit codes. Phase 1 the exponent histogram's 160 counts packed in words; phase 2 three header values (bits, scale exponent, 1) then words of packed unsigned lanes. The words are int64 where the transport adds int64 (torch.distributed; parameter servers that say they add it), else float64.

THC (Li et al., NSDI'24): every worker quantizes against one *shared* scale, so the servers (or
an all_reduce) add the integer codes without decoding them, and each worker decodes the sum
once. One reduce takes two plain-sum phases, which the communicators drive like PowerSGD's
(bps_gc/comm/phased.py), so parameter servers and collectives only ever sum dense words
(int64, wrapping modulo 2^64: all 64 bits of a word; float64, the default: 53 exact bits; the
formulas below say float64's 53, int64's replace it by 64):

1. ``compress(x, ctx)``: y = x (or its randomized Hadamard rotation); the histogram has a 1 in
   the bin of e = ceil(log2 max|y|) (clipped to [-126, 32]; the last bin for a non-finite
   input). Its sum counts the summands, and its highest nonzero bin is the shared exponent.
   The 160 counts travel packed like the codes: lanes of c = bit_length(N) bits (a count is
   at most N), floor(53 / c) to a float64 word (7 words for N = 2, 54 for N = 8,192).
2. ``compress_q(hist_sum)``: the scale s = 2^e; each element's code q in [0, M], M = 2^b - 1,
   is (y/s + 1) M/2 rounded stochastically (unbiased: E q = that) or, with ``feedback``, to the
   nearest (ties up) and the error kept for the next step (the C kernel kernels/thc.c, or its
   AVX-512 twins thc_encode_avx512.c and thc_decode_avx512.c, bit for bit; compress keeps a
   view of a float32 input for compress_q, not a copy). Codes are packed k = floor(53 / w) to a
   float64 word in lanes of w = b + ceil(log2 N) bits (N summands), so the sum of N words is
   an integer below 2^53, exact in float64 in any order, and no lane carries into the next.
3. ``finish(code_sum, out, workers)``: the summed header must say N pushes of this bit width
   and scale (else ValueError, and ``out`` is untouched); out = s (2 Q / M - N), rotated back.

The rotation: per block of B = min(4096, next power of two >= n) elements, H D with D a random
+-1 diagonal and H the orthonormal Walsh-Hadamard matrix; D's seed derives from the partition's
seed and the step (``chain.derive_seed``), so every worker rotates alike. The scale agreement
is phase 1: one extra sum of 56-432 bytes per partition for 2 to 8,192 summands (one more
all_reduce per bucket, or one more push and pull of a dense key per partition on the parameter
server).
"""
import functools
import math

import numpy as np

from . import seeds
from ._native import ERRORS, lib, ptr
from .base import Codec
from .params import CODEC_OPTIONS
from .reducers import PhasedSums, register_reducer
from .registry import register_compressor
from .seeds import MASK64, derive_seed, mixed_state

BITS = (2, 4, 8)
E_MIN, E_MAX = -126, 32  # scale exponents the histogram holds
HIST = E_MAX - E_MIN + 2  # one bin per exponent, then the non-finite bin
HEADER = 3  # bits, exponent, count (each summed over the pushes)
CARRIER = np.dtype(np.float64)  # the default words: any server adds dense float64 exactly
CARRIER_BITS = 53  # integers below 2^53 add exactly in float64
# the bits of a word each carrier adds exactly: int64 (torch.distributed's words, and the
# parameter server's when every server adds int64: ps/membership/membership.py phase_words)
# wraps modulo 2^64, which leaves every bit of a sum below 2^64 right when the word is read unsigned
WORD_BITS = {CARRIER: CARRIER_BITS, np.dtype(np.int64): 64}
BLOCK = 4096  # largest Hadamard block


@functools.lru_cache(maxsize=64)  # every finish asks (its sum's size and lanes); one answer per pair
def lane_bits(bits, summands):
    """Lane width for the sum of ``summands`` codes of ``bits`` bits: b + ceil(log2 N)."""
    if bits not in BITS:
        raise ValueError(f"thc: bits must be one of {BITS}, got {bits!r}")
    if int(summands) < 1:
        raise ValueError(f"thc: the sum needs >= 1 summand, got {summands!r}")
    width = bits + math.ceil(math.log2(int(summands)))
    if width > CARRIER_BITS:
        raise ValueError(f"thc: {summands} summands of {bits}-bit codes need {width}-bit lanes, "
                         f"more than the {CARRIER_BITS} bits a float64 word adds exactly; "
                         f"use fewer bits or fewer summands")
    return width


def count_bits(summands):
    """Lane width of a summed histogram count (0 to N): bit_length(N)."""
    return max(1, int(summands).bit_length())


def word_bits(carrier):
    """Bits a word of ``carrier`` (float64 or int64) adds exactly; ValueError for another."""
    bits = WORD_BITS.get(np.dtype(carrier))
    if bits is None:
        raise ValueError(f"thc: words are float64 or int64, not {np.dtype(carrier)}")
    return bits


def histogram_words(bin_, summands, carrier=CARRIER):
    """One push's histogram (a 1 in ``bin_``) packed for ``summands`` pushes: words of ``carrier``."""
    width, bits = count_bits(summands), word_bits(carrier)
    k = lanes_per_word(width, bits)
    words = np.zeros(words_for(HIST, width, bits), np.uint64)
    words[bin_ // k] = np.uint64(1 << (bin_ % k) * width)
    return words.astype(CARRIER) if bits == CARRIER_BITS else words.view(np.int64)


def unpack_counts(words, width, count_):
    """The first ``count_`` lanes of ``width`` bits of summed ``words`` (float64 or int64), as
    int64; a ValueError for a float64 word that is not an integer in [0, 2^53) (an overflowed
    or foreign sum)."""
    words = np.asarray(words)
    bits = word_bits(words.dtype)
    if bits == CARRIER_BITS:
        if not np.all((words >= 0) & (words < 2.0 ** CARRIER_BITS) & (words == np.floor(words))):
            raise ValueError("thc: a summed word is not an integer in [0, 2^53): a lane overflowed")
        unsigned = words.astype(np.uint64)
    else:
        unsigned = words.view(np.uint64)
    k = lanes_per_word(width, bits)
    shifts = np.arange(k, dtype=np.uint64) * np.uint64(width)
    lanes = (unsigned[:, None] >> shifts) & np.uint64((1 << width) - 1)
    return lanes.reshape(-1)[:count_].astype(np.int64)


def lanes_per_word(width, bits=CARRIER_BITS):
    """Lanes of ``width`` bits a word adds exactly (``bits``: word_bits of its carrier)."""
    return bits // width


def words_for(count_, width, bits=CARRIER_BITS):
    return -(-count_ // lanes_per_word(width, bits))


def hadamard(x, cat=np.concatenate):
    """Orthonormal Walsh-Hadamard transform of each row of ``x`` (rows of 2^m); its own inverse.
    ``cat``: numpy's concatenate, or torch.cat for tensors (the device chain)."""
    rows, size = x.shape
    h = 1
    while h < size:
        x = x.reshape(rows, size // (2 * h), 2, h)
        x = cat([x[:, :, :1] + x[:, :, 1:], x[:, :, :1] - x[:, :, 1:]], 2)
        h *= 2
    return x.reshape(rows, size) * (1 / math.sqrt(size))


def rotation_signs(seed, ctx, block):
    """This step's +-1 diagonal D (``block`` float32 values): every worker draws the same."""
    step = ctx.get("step", 0) if isinstance(ctx, dict) else 0
    rng = np.random.default_rng(rotation_seed(seed, step))
    return (rng.integers(0, 2, block, np.int8) * 2 - 1).astype(np.float32)


def rotated(x, signs, block, inverse=False, cat=np.concatenate):
    """x (a multiple of ``block`` elements) rotated by H D per block, or back by D H."""
    blocks = x.reshape(-1, block)
    if inverse:
        return (hadamard(blocks, cat) * signs).reshape(-1)
    return hadamard(blocks * signs, cat).reshape(-1)


def block_size(n):
    return min(BLOCK, 1 << max(0, (int(n) - 1).bit_length()))


def rotation_seed(seed, step):
    """The rotation's seed at ``step``: every worker derives the same one from the key's seed."""
    return derive_seed((int(seed) + int(step) * 0x9E3779B97F4A7C15) & MASK64)


def exponent_bin(peak):
    """Histogram bin of a partition's max |y|: its exponent ceil(log2), or the last bin."""
    if not math.isfinite(peak):
        return HIST - 1
    if peak <= 0:
        return 0
    mantissa, exp = math.frexp(peak)  # peak = mantissa 2^exp, mantissa in [0.5, 1)
    exp = exp - 1 if mantissa == 0.5 else exp  # an exact power of two is its own scale
    return min(max(exp, E_MIN), E_MAX) - E_MIN


def agreed_scale(hist_sum, lanes_for):
    """(summands, exponent, any non-finite push) from the summed histogram words (float64 or
    int64), packed for ``lanes_for`` pushes."""
    words = np.asarray(hist_sum).reshape(-1)
    return _agreed_scale(words.tobytes(), words.dtype.str, int(lanes_for))


@functools.lru_cache(maxsize=256)
def _agreed_scale(raw, dtype, lanes_for):
    """agreed_scale of a histogram's bytes: sums repeat from step to step, and unpacking one
    costs a dozen numpy calls (20 us, a tenth of a 1M-element encode)."""
    width, words = count_bits(lanes_for), np.frombuffer(raw, dtype)
    expected = words_for(HIST, width, word_bits(words.dtype))
    if words.size != expected:
        raise ValueError(f"thc: a summed histogram must be {expected} words ({HIST} counts "
                         f"in {width}-bit lanes), got {words.size}")
    hist = unpack_counts(words, width, HIST)
    summands = int(hist.sum())
    if summands < 1:
        raise ValueError("thc: the summed histogram counts no push")
    nonzero = np.flatnonzero(hist[:-1])
    exponent = int(nonzero[-1]) + E_MIN if nonzero.size else E_MIN
    return summands, exponent, bool(hist[-1])


@register_compressor("thc", options=CODEC_OPTIONS["thc"])
class THC(Codec):
    reducers = ("thc",)  # two plain-sum phases (the reducer below)
    draws_per_worker = True  # build_chain passes worker_seed: the rounding's, from seed, key and rank
    state_attrs = ("rng_state", "error")  # stochastic rounding's words; feedback's residual (None without)

    def state_identity(self):  # the device codec draws from torch's generator instead
        return {**super().state_identity(), "rng": "xorshift128+"}

    def __init__(self, params, n, dtype, seed, worker_seed=None):
        super().__init__(params, n, dtype)
        if self.dtype not in (np.float32, np.float16):
            raise TypeError(f"thc: float32 or float16 partitions only, got {self.dtype}")
        options = dict(params.options)
        self.bits = int(options.get("bits", 4))
        lane_bits(self.bits, 1)
        self.rotate = bool(options.get("rotate", False))
        self.feedback = bool(options.get("feedback", False))
        self.levels = (1 << self.bits) - 1
        self.seed = int(seed)
        self.block = block_size(self.n) if self.rotate else 1
        self.codes = -(-self.n // self.block) * self.block if self.rotate else self.n
        # stochastic rounding must differ between workers (their errors then average out) and
        # repeat between launches: its stream is the worker's (build_chain: seed, key, rank),
        # carried across steps (and checkpoints) as randomk's and dithering's are; a codec made
        # without build_chain draws rank 0's stream of key 0
        self.worker_seed = int(worker_seed) if worker_seed is not None else seeds.worker_seed(seed, 0, 0)
        self.rng_state = mixed_state(self.worker_seed)
        self.error = np.zeros(self.n, np.float32) if self.feedback else None
        self.x = self.y = self.signs = self.agreed = self.peak = None
        self.set_summands(1, CARRIER)

    def set_summands(self, summands, carrier=None):
        """Size the code lanes for ``summands`` pushes (the communicator's worker count), in
        words of ``carrier`` (float64, the default; int64, torch.distributed's and the parameter
        server's where its servers add it, hold 64 bits)."""
        width = lane_bits(self.bits, summands)
        if carrier is not None:
            word_bits(carrier)
            self.phase_dtype = np.dtype(carrier)
        self.summands = int(summands)
        # what every round asks, worked out once per sizing (a finish is microseconds of Python)
        self.width, self.word_bits = width, WORD_BITS[self.phase_dtype]
        self.phase_sizes = (words_for(HIST, count_bits(self.summands), self.word_bits),
                            HEADER + words_for(self.codes, self.width, self.word_bits))

    def _rotate(self, x, inverse=False):
        """A rotated copy of x (float32, ``codes`` long): ``rotated``'s operations in C."""
        out = np.array(x, np.float32)
        lib.thc_rotate_f32(ptr(out), out.size // self.block, self.block, ptr(self.signs), int(inverse),
                           1 / math.sqrt(self.block))
        return out

    def compress(self, x, ctx=None):
        # no copy of a float32 input: compress_q reads it again, and the communicators leave
        # it alone until finish (comm/phased.py reads every partition before writing one)
        x = self._input(x)
        x = x if x.dtype == np.float32 else x.astype(np.float32)
        if self.feedback:  # x + the residual, in a new array, and its peak in the same pass
            x, given = np.empty(self.n, np.float32), x
            peak = lib.thc_peak_f32(ptr(given), ptr(self.error), ptr(x), self.n)
        self.x = x  # what the codes stand for (error feedback's base)
        if self.rotate:
            self.signs = rotation_signs(self.seed, ctx, self.block)
            padded = np.zeros(self.codes, np.float32)
            padded[:self.n] = x
            self.y = self._rotate(padded)
        else:
            self.y = x
        if self.rotate or not self.feedback:
            peak = lib.thc_peak_f32(ptr(self.y), None, None, self.y.size)  # NaN for a non-finite one
        self.peak = peak
        return histogram_words(exponent_bin(peak), self.summands, self.phase_dtype).view(np.uint8)

    def agree(self, hist_sum):
        """The scale from the summed histogram (phase 1); (exponent, any non-finite push)."""
        summands, exponent, nonfinite = agreed_scale(np.asarray(hist_sum).view(self.phase_dtype), self.summands)
        if summands != self.summands:
            raise ValueError(f"thc: phase 1 counted {summands} pushes, but the lanes are sized for "
                             f"{self.summands}: their codes would overflow (or waste) the lanes")
        self.agreed = (exponent, nonfinite)
        return self.agreed

    def compress_q(self, hist_sum):
        exponent, nonfinite = self.agree(hist_sum)
        width, bits = self.width, self.word_bits
        words = np.empty(self.phase_sizes[1], self.phase_dtype)
        words[:HEADER] = (self.bits, exponent, 1)
        if nonfinite:  # the sum is NaN anyway; zeros keep the lanes valid
            words[HEADER:] = 0
        else:
            # feedback: the codes decoded alone, or (unrotated) straight away the residual
            # x - decoded, written over x (compress's own array, needed no more)
            minuend = self.x if self.feedback and not self.rotate else None
            own = (minuend if minuend is not None else np.empty(self.codes, np.float32)) if self.feedback else None
            y = np.ascontiguousarray(self.y, np.float32)
            bounded = self.peak * 2.0 ** -exponent <= 1.0  # no code to clamp (the kernel's fast path)
            lib.thc_pack_f32(ptr(y), self.codes, 2.0 ** -exponent, self.levels, width, lanes_per_word(width, bits),
                             int(bounded), None if self.feedback else ptr(self.rng_state),
                             None if minuend is None else ptr(minuend), None if own is None else ptr(own),
                             ptr(words[HEADER:]), int(bits != CARRIER_BITS))
            if minuend is not None:
                self.error, self.x = own, None
            elif self.feedback:  # the residual, written over the decoded copy it no longer needs
                decoded = self._rotate(own, inverse=True)[:self.n]
                self.error = np.subtract(self.x, decoded, out=decoded)
        return words.view(np.uint8)

    def check_sum(self, size, header):
        """Refuse a summed phase-2 buffer of ``size`` words whose ``header`` (its first three
        summed values) disagrees with this round: ValueError naming what disagrees."""
        if self.agreed is None:
            raise ValueError("thc: finish() before compress_q()")
        expected = self.phase_sizes[1]
        if size != expected:
            raise ValueError(f"thc: a summed code buffer of {size} words, expected {expected} "
                             f"({self.bits}-bit codes in {self.width}-bit lanes)")
        exponent = self.agreed[0]
        bits_sum, exp_sum, pushes = np.asarray(header[:HEADER], np.float64).tolist()
        if pushes != self.summands:
            raise ValueError(f"thc: the sum holds {pushes:g} pushes, its lanes hold {self.summands}")
        if bits_sum != self.bits * self.summands:
            raise ValueError(f"thc: a push with another bit width (bit widths sum to {bits_sum:g}, "
                             f"expected {self.summands} x {self.bits})")
        if exp_sum != exponent * self.summands:
            raise ValueError(f"thc: a push with another scale (exponents sum to {exp_sum:g}, "
                             f"expected {self.summands} x {exponent})")

    def finish(self, code_sum, out=None, workers=1):
        buf = np.asarray(code_sum).reshape(-1).view(self.phase_dtype)
        self.check_sum(buf.size, buf[:HEADER])
        exponent, nonfinite = self.agreed
        out = self._output(out)
        direct = out.dtype == np.float32 and not self.rotate
        values = out if direct else np.empty(self.codes, np.float32)
        words = buf[HEADER:]
        if not (words.flags.c_contiguous and words.flags.aligned):
            words = words.copy()
        width, bits = self.width, self.word_bits
        code = lib.thc_unpack_f64(ptr(words), words.size, self.codes, width, lanes_per_word(width, bits),
                                  2.0 ** exponent, self.levels, float(self.summands), ptr(values),
                                  int(bits != CARRIER_BITS))
        if code < 0:  # checked before anything was written
            raise ValueError("thc: a summed word is not an integer in [0, 2^53): a lane overflowed"
                             if code == -3 else f"thc: {ERRORS.get(code, code)}")
        if nonfinite:
            out[:] = np.nan
            return out
        if self.rotate:
            values = self._rotate(values, inverse=True)[:self.n]
        if not direct:
            with np.errstate(over="ignore"):
                out[:] = values
        return out

    def decompress(self, payload, out=None):
        """A summed phase-2 buffer of this step, decoded (``finish``)."""
        return self.finish(self._payload(payload), out, self.summands)


@register_reducer("thc")
class CodeSums(PhasedSums):
    """thc's reduction: two phases of plain sums (the scale histogram, then the packed codes),
    which the communicator drives; servers add the codes as dense int64 words, 64 bits
    (float64, exact below 2^53, where a server does not add int64), as torch.distributed does,
    and never decode them."""

    phase_sums = "histogram and code phases are sums"
    host_first = True  # two levels sum the host's floats, then one code per host (comm/phased.py)
