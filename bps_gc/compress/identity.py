"""identity: the payload is the partition's elements as they are (``n * sizeof(T)`` bytes, the
dense push's); decode gives them back exactly. It compresses nothing: it lets a dense tensor
take a reducer that runs on the servers, as DiLoCo's outer step (reducer ``outer_sgd``,
compress/outer.py) with dense pseudo-gradients, the servers decoding the pushes as any codec's,
so no transport knows of it. Since it saves no bytes, BYTEPS_MIN_COMPRESS_BYTES does not send a
small tensor of it raw (``raw_when_small``): its reducer runs on every tensor declared with it."""
import numpy as np

from .base import Codec
from .registry import register_compressor


@register_compressor("identity")
class Identity(Codec):
    raw_when_small = False  # comm/placement.py: compressed at any size

    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)
        self.nbytes = self.n * self.dtype.itemsize

    def compress(self, x, ctx=None):
        return self._input(x).view(np.uint8).copy()

    def elements(self, payload):
        """The payload's elements (a copy where the received buffer is not aligned for them)."""
        buf = self._payload(payload, self.nbytes)
        return (buf if buf.ctypes.data % self.dtype.itemsize == 0 else buf.copy()).view(self.dtype)

    def decompress(self, payload, out=None):
        out = self._output(out)
        out[:] = self.elements(payload)
        return out

    def decompress_add(self, payload, acc):
        acc += self.elements(payload)

    def residual(self, payload, x):
        x -= self.elements(payload)  # zero, unless the input held NaN or inf
