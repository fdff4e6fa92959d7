"""dithering: stochastic quantization to s linear or natural (power-of-two) levels.

Nonzero levels are written as Elias-delta(gap), sign bit, Elias-delta(level) into a bit stream
of 32-bit words (64-bit for float64), followed by the bit count and the float32 scale.
"""
import numpy as np

from ._native import ERR_NONFINITE, ERR_OVERFLOW, check, lib, ptr
from .base import Codec
from .registry import register_compressor


@register_compressor("dithering")
class Dithering(Codec):
    state_attrs = ("rng_state",)

    def state_identity(self):  # the device codec draws from torch's generator instead
        return {**super().state_identity(), "rng": "xorshift128+"}

    def __init__(self, params, n, dtype, seed):
        super().__init__(params, n, dtype)
        self.s = int(params.k)
        self.natural = params.partition == "natural"
        self.s_eff = float(2 ** (self.s - 1) if self.natural else self.s)
        self.rng_state = np.array([seed, seed], np.uint64)
        kind = "f64" if self.dtype == np.float64 else "f32"  # float16: we differ, 32-bit words
        self._encode = getattr(lib, "dithering_compress_" + kind)
        self._decode = getattr(lib, "dithering_decompress_" + kind)
        self._capacity = 2 * self.n + 64  # 16 bits an element; retried with the worst case

    def compress(self, x, ctx=None):
        x = self._input(x)
        if self.dtype == np.float16:
            x = x.astype(np.float32)
        saved = self.rng_state.copy()
        while True:
            out = np.empty(self._capacity, np.uint8)
            size = self._encode(ptr(x), self.n, self.s, int(self.natural),
                                int(self.params.normalize == "l2"), ptr(self.rng_state),
                                ptr(out), out.size)
            if size != ERR_OVERFLOW:
                break
            # per element at most 4 bits of gap, a sign and Elias-delta(level) <= 43 bits
            self.rng_state[:] = saved
            self._capacity = 6 * self.n + 64
        if size < 0:
            self.rng_state[:] = saved
        if size == ERR_NONFINITE:
            return self._nonfinite_payload()
        return out[: check(size, "dithering")]

    def _nonfinite_payload(self):
        """For inf or NaN input: one entry (index 0, level 1) and a NaN scale, so the decoded
        partition (and any sum it joins) shows the non-finite gradient; the generator does not
        move."""
        word = np.dtype(np.uint64 if self.dtype == np.float64 else np.uint32)
        stream = np.array([0b101 << (word.itemsize * 8 - 3), 3], word)  # "1" "0" "1", 3 bits
        return np.concatenate([stream.view(np.uint8), np.array([np.nan], np.float32).view(np.uint8)])

    def decompress(self, payload, out=None):
        buf = np.ascontiguousarray(self._payload(payload))
        out = self._output(out)
        target = np.empty(self.n, np.float32) if self.dtype == np.float16 else out
        check(self._decode(ptr(buf), buf.size, self.s_eff, self.n, ptr(target)),
              "dithering")
        if target is not out:
            with np.errstate(over="ignore"):  # a float32 scale beyond float16's range
                out[:] = target
        return out
