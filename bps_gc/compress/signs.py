"""sign (signSGD, decoded to +-1, for the majority-vote reducer) and signnorm (scaled sign,
(||x||_1 / n) * sign(x)): onebit without and with scaling, under the names users call them.
Format: onebit's (sign bits, 1 = negative; 0, -0 and NaN give 0; MSB first in words as wide as
the element, 16 bits for float16; then a float32 scale: 1 for sign, NaN for inf/NaN input)."""
import numpy as np

from .onebit import Onebit
from .registry import register_compressor


class _SignCodec(Onebit):
    scaling = None  # fixed by the subclass, whatever params.scaling says

    def __init__(self, params, n, dtype, seed=None):
        scaling = type(self).scaling
        super().__init__(params, n, dtype)
        self.scaling = scaling
        if self.dtype not in (np.float32, np.float16):
            raise TypeError(f"{type(self).__name__}: float32 or float16 partitions only, got {self.dtype}")


@register_compressor("signnorm")
class SignNorm(_SignCodec):
    scaling = True


@register_compressor("sign")
class Sign(_SignCodec):
    scaling = False
    reducers = ("majority", "lossless", "recompress")
