"""randomk on the device: compress/sparse.py's payload (``k`` packed little-endian records,
uint32 index and value, uint64 indices for float64) at indices drawn with replacement by
xorshift128+ seeded as BytePS did (``a = b = seed``), state carried across steps.

Why the indices are drawn on the host: with the ``recompress`` reducer the server's codec for
the key re-selects the sum at the indices it draws itself, and the pull is only the summed
gradient where every worker drew the same indices at the same step. Those indices are the
numpy chain's xorshift128+ sequence, which is sequential (each output needs the one before),
so the ``k`` draws run on the host with the numpy chain's own kernel and only the indices
(``8k`` bytes) are copied to the device; the tensor never leaves it. The payload is then
byte-identical to the numpy chain's.
"""
import numpy as np
import torch

from .._native import lib, ptr
from .registry import register_device_compressor
from .sparse import DeviceSparseCodec


@register_device_compressor("randomk")
class DeviceRandomK(DeviceSparseCodec):
    """randomk's indices from the host's xorshift128+ (see the module doc), values gathered and
    scattered on the device (a repeated index counts once, as numpy)."""

    state_attrs = ("rng_state",)  # host words, as the numpy codec's

    def __init__(self, params, n, dtype, seed, device, **extra):
        super().__init__(params, n, dtype, seed, device)
        self.rng_state = np.array([seed, seed], np.uint64)  # as compress/sparse.py's RandomK
        self._drawn = np.empty(self.k, np.uint32)

    def indices(self, x=None):
        """The next k indices (int64, on the device); advances the generator like numpy's."""
        lib.randomk_indices(ptr(self.rng_state), self.n, self.k, ptr(self._drawn))
        return torch.from_numpy(self._drawn.astype(np.int64)).to(self.device)
