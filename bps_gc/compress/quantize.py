"""TernGrad and QSGD: unbiased stochastic quantizers with a float32 scale in front.

Both draw one Bernoulli per element (32 random bits, two per xorshift128+ output, high half
first) from a generator seeded through splitmix64 (``seeds.mixed_state``); the state carries
over between steps. float16 partitions are quantized in float32 (exact) and decoded back.
"""
import math

import numpy as np

from ._native import check, lib, ptr
from .base import Codec
from .params import CODEC_OPTIONS
from .registry import register_compressor
from .seeds import mixed_state

F32_MAX = float(np.finfo(np.float32).max)


class StochasticQuantizer(Codec):
    """Shared: float32/float16 only, the generator, the float32 header, float16 decoding."""

    HEADER = 4  # float32 scale
    state_attrs = ("rng_state",)

    def state_identity(self):  # the device codecs draw from torch's generator instead
        return {**super().state_identity(), "rng": "xorshift128+"}

    def __init__(self, params, n, dtype, seed):
        super().__init__(params, n, dtype)
        if self.dtype not in (np.float32, np.float16):
            raise TypeError(f"{type(self).__name__}: float32 or float16 partitions only, got {self.dtype}")
        self.rng_state = mixed_state(seed)
        self.body_bytes = None  # set by subclasses

    def _as_f32(self, x):
        x = self._input(x)
        return x.astype(np.float32) if self.dtype == np.float16 else x

    def _header(self, scale):
        return np.array([scale], np.float32).view(np.uint8)

    def _split(self, payload):
        buf = self._payload(payload, self.HEADER + self.body_bytes)
        scale = float(buf[: self.HEADER].view(np.float32)[0])
        return scale, np.ascontiguousarray(buf[self.HEADER:])

    def _decode_into(self, out, decode):
        """decode(target) writes float32; float16 outputs go through a float32 buffer."""
        out = self._output(out)
        if self.dtype == np.float32:
            decode(out)
            return out
        tmp = np.empty(self.n, np.float32)
        decode(tmp)
        with np.errstate(over="ignore"):
            out[:] = tmp
        return out


@register_compressor("terngrad", options=CODEC_OPTIONS["terngrad"])
class TernGrad(StochasticQuantizer):
    """s = max|x| (after clipping to 2.5 standard deviations with ``clip``);
    t_i = sign(x_i) * Bernoulli(|x_i| / s); decodes to s * t."""

    def __init__(self, params, n, dtype, seed):
        super().__init__(params, n, dtype, seed)
        self.clip = bool(dict(params.options).get("clip", False))
        self.body_bytes = -(-self.n // 4)

    def compress(self, x, ctx=None):
        x = self._as_f32(x)
        peak = float(np.array([lib.key_max_u32(ptr(x), self.n)], np.uint32).view(np.float32)[0])
        bound = math.inf
        if self.clip and math.isfinite(peak):
            moments = np.empty(2, np.float64)
            lib.moments_f32(ptr(x), self.n, ptr(moments))
            mean = moments[0] / self.n
            std = math.sqrt(max(0.0, moments[1] / self.n - mean * mean))
            bound = float(np.float32(2.5 * std))
        scale = float(np.float32(min(peak, bound)))
        out = np.empty(self.HEADER + self.body_bytes, np.uint8)
        out[: self.HEADER] = self._header(scale if math.isfinite(peak) else math.nan)
        if scale > 0 and math.isfinite(peak):
            lib.terngrad_compress_f32(ptr(x), self.n, bound, scale, ptr(self.rng_state),
                                      ptr(out[self.HEADER:]))
        else:  # all zeros; or non-finite, which a NaN scale carries to every element
            out[self.HEADER:] = 0
        return out

    def decompress(self, payload, out=None):
        scale, codes = self._split(payload)
        return self._decode_into(out, lambda y: check(
            lib.terngrad_decompress_f32(ptr(codes), self.n, scale, ptr(y)), "terngrad"))


def qsgd_bits(levels):
    """Bits per element: the level (0..Q) and a sign."""
    return int(levels).bit_length() + 1


@register_compressor("qsgd", options=CODEC_OPTIONS["qsgd"])
class QSGD(StochasticQuantizer):
    """l_i = Q |x_i| / ||x||_2; level = floor(l) + Bernoulli(l - floor(l)); decodes to
    sign * ||x||_2 * level / Q (divided by tau = 1 + min(n/Q^2, sqrt(n)/Q) with ``biased``)."""

    def __init__(self, params, n, dtype, seed):
        super().__init__(params, n, dtype, seed)
        options = dict(params.options)
        self.levels = int(options.get("levels", 255))
        self.biased = bool(options.get("biased", False))
        self.bits = qsgd_bits(self.levels)
        self.body_bytes = -(-self.n * self.bits // 8)
        q = self.levels
        self.tau = 1.0 + min(self.n / q / q, math.sqrt(self.n) / q) if self.biased else 1.0

    def compress(self, x, ctx=None):
        x = self._as_f32(x)
        moments = np.empty(2, np.float64)
        lib.moments_f32(ptr(x), self.n, ptr(moments))
        norm = math.sqrt(moments[1]) if math.isfinite(moments[1]) else math.nan
        out = np.empty(self.HEADER + self.body_bytes + 8, np.uint8)  # the kernel's 8-byte stores
        stored = float(np.float32(min(norm, F32_MAX))) if math.isfinite(norm) else math.nan
        out[: self.HEADER] = self._header(stored)
        if norm > 0 and math.isfinite(norm):
            if self.levels / norm > F32_MAX:  # a partition of subnormals: scale it up, exactly
                x, norm = x * np.float32(2.0**100), norm * 2.0**100
            mult = float(np.float32(self.levels / norm))
            size = lib.qsgd_compress_f32(ptr(x), self.n, mult, self.levels, self.bits,
                                         ptr(self.rng_state), ptr(out[self.HEADER:]))
            assert size == self.body_bytes
        else:  # zeros; or non-finite, which a NaN norm carries to every element
            out[self.HEADER:] = 0
        return out[: self.HEADER + self.body_bytes]

    def decompress(self, payload, out=None):
        norm, body = self._split(payload)
        scale = float(np.float32(norm / (self.levels * self.tau)))
        return self._decode_into(out, lambda y: check(lib.qsgd_decompress_f32(
            ptr(body), body.size, self.n, self.levels, self.bits, scale, ptr(y)), "qsgd"))
