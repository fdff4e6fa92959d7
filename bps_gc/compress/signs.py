"""sign (signSGD, decoded to +-1, for the majority-vote reducer) and signnorm (scaled sign,
(||x||_1 / n) * sign(x)). Both use onebit's format: sign bits (1 = negative; 0, -0 and NaN
give 0) MSB first in words as wide as the element (16 bits for float16), then a float32 scale."""
import math

import numpy as np

from .onebit import Onebit
from .registry import register_compressor


@register_compressor("signnorm")
class SignNorm(Onebit):
    """onebit with ``scaling`` always on: the scale is mean |x| = ||x||_1 / n."""

    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)
        if self.dtype not in (np.float32, np.float16):
            raise TypeError(f"signnorm: float32 or float16 partitions only, got {self.dtype}")

    def compress(self, x, ctx=None):
        return self.encode(x)

    def encode(self, x):
        x = self._input(x)
        if self.dtype == np.float16:
            x = x.astype(np.float32)
        out = np.empty(self.words_bytes + 4, np.uint8)
        scale = self._encode(x.ctypes.data, self.n, 1, out.ctypes.data)
        out[self.words_bytes:] = np.array([scale], np.float32).view(np.uint8)
        return out


@register_compressor("sign")
class Sign(SignNorm):
    """sign(x) as +-1; the scale is 1, or NaN when x holds inf or NaN (one bit cannot carry a
    non-finite gradient, the scale does, so the round's result shows it)."""

    reducers = ("majority", "lossless", "recompress")

    def compress(self, x, ctx=None):
        out = self.encode(x)  # scaling on: the mean |x| is finite exactly when x is
        scale = out[self.words_bytes:].view(np.float32)
        scale[0] = 1.0 if math.isfinite(scale[0]) else math.nan
        return out
