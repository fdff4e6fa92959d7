"""onebit: signSGD. One bit per element (1 = negative), MSB first, then a float32 scale."""
import math

import numpy as np

from ._native import lib, ptr
from .base import Codec
from .registry import register_compressor

WORD_BITS = {np.float32: 32, np.float64: 64, np.float16: 16}
SUFFIX = {np.float32: "f32", np.float64: "f64", np.float16: "f16"}


@register_compressor("onebit")
class Onebit(Codec):
    reducers = ("recompress", "lossless", "majority")  # its decode gives signs

    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)
        self.scaling = bool(params.scaling)
        bits = WORD_BITS[self.dtype.type]
        self.words_bytes = -(-self.n // bits) * bits // 8
        suffix = SUFFIX[self.dtype.type]
        self._encode = getattr(lib, "onebit_compress_" + suffix)
        self._decode = getattr(lib, "onebit_decompress_" + suffix)
        self._residual = getattr(lib, "onebit_residual_" + suffix, None)  # none for float16

    def compress(self, x, ctx=None):
        x = self._input(x)
        if self.dtype == np.float16:  # float16 -> float32 is exact; the kernel packs 16-bit words
            x = x.astype(np.float32)
        out = np.empty(self.words_bytes + 4, np.uint8)
        # the mean |x| is always summed (it costs little): without scaling the scale is 1, or
        # NaN for inf/NaN input, so that a non-finite gradient shows in the round's result
        scale = self._encode(ptr(x), self.n, 1, ptr(out))
        if not self.scaling:
            scale = 1.0 if math.isfinite(scale) else math.nan
        out[self.words_bytes:] = np.array([scale], np.float32).view(np.uint8)
        return out

    def decompress(self, payload, out=None):
        buf = self._payload(payload, self.words_bytes + 4)
        words = np.ascontiguousarray(buf[: self.words_bytes])
        scale = float(buf[self.words_bytes:].view(np.float32)[0])
        out = self._output(out)
        if self.dtype == np.float16:
            tmp = np.empty(self.n, np.float32)
            self._decode(ptr(words), scale, self.n, ptr(tmp))
            with np.errstate(over="ignore"):  # a float32 scale beyond float16's range
                out[:] = tmp
        else:
            self._decode(ptr(words), scale, self.n, ptr(out))
        return out

    def residual(self, payload, x):
        if self._residual is None:
            return super().residual(payload, x)
        buf = self._payload(payload, self.words_bytes + 4)
        scale = float(buf[self.words_bytes:].view(np.float32)[0])
        self._residual(ptr(np.ascontiguousarray(buf[: self.words_bytes])), scale, self.n, ptr(x))
