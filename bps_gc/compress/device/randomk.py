"""randomk on the device, and the packed (index, value) records it shares with DGC.

The payload is compress/sparse.py's: ``k`` packed little-endian records (uint32 index, value;
uint64 indices for float64), indices drawn with replacement by xorshift128+ seeded as BytePS
did (``a = b = seed``), state carried across steps.

Why the indices are drawn on the host: with the ``recompress`` reducer the server's codec for
the key re-selects the sum at the indices it draws itself, and the pull is only the summed
gradient where every worker drew the same indices at the same step. Those indices are the
numpy chain's xorshift128+ sequence, which is sequential (each output needs the one before),
so the ``k`` draws run on the host with the numpy chain's own kernel and only the indices
(``4k`` bytes, the size of the payload's index half) are copied to the device; the tensor never
leaves it. The payload is then byte-identical to the numpy chain's.
"""
import numpy as np
import torch

from .._native import lib, ptr
from ..sparse import resolve_k
from .base import DeviceCodec
from .registry import register_device_compressor

# index type of the records per partition dtype (sparse.RECORD): uint32, uint64 for float64
RECORD_INDEX = {np.dtype(np.float32): torch.int32, np.dtype(np.float64): torch.int64,
                np.dtype(np.float16): torch.int32}


def pack_records(idx, values, index_dtype):
    """Packed records (index, value) as a flat uint8 tensor: ``idx`` (int64) is stored as
    ``index_dtype`` (int32 holds a uint32 index's bits), ``values`` as they are."""
    count = idx.numel()
    index_bytes = idx.to(index_dtype).view(torch.uint8).view(count, -1)
    value_bytes = values.contiguous().view(torch.uint8).view(count, -1)
    return torch.cat([index_bytes, value_bytes], 1).reshape(-1)


def unpack_records(buf, index_dtype, value_dtype, what):
    """(int64 indices, values) of packed records in a uint8 tensor; uint32 indices come back
    as their unsigned values."""
    index_size = torch.empty(0, dtype=index_dtype).element_size()
    record = index_size + torch.empty(0, dtype=value_dtype).element_size()
    if buf.numel() % record:
        raise ValueError(f"{what}: payload of {buf.numel()} bytes is not a whole number of "
                         f"{record}-byte records")
    rows = buf.view(-1, record)
    idx = rows[:, :index_size].contiguous().view(index_dtype).reshape(-1).to(torch.int64)
    if index_dtype == torch.int32:
        idx &= 0xFFFFFFFF
    values = rows[:, index_size:].contiguous().view(value_dtype).reshape(-1)
    return idx, values


@register_device_compressor("randomk")
class DeviceRandomK(DeviceCodec):
    """randomk's indices from the host's xorshift128+ (see the module doc), values gathered on
    the device; decoding scatters on the device (a repeated index counts once, as numpy)."""

    def __init__(self, params, n, dtype, seed, device, **extra):
        super().__init__(params, n, dtype, seed, device)
        self.k = resolve_k(params.k, self.n)
        self.rng_state = np.array([seed, seed], np.uint64)  # as compress/sparse.py's RandomK
        self.index_dtype = RECORD_INDEX[self.dtype]
        self._drawn = np.empty(self.k, np.uint32)

    def indices(self):
        """The next k indices (int64, on the device); advances the generator like numpy's."""
        lib.randomk_indices(ptr(self.rng_state), self.n, self.k, ptr(self._drawn))
        return torch.from_numpy(self._drawn.astype(np.int64)).to(self.device)

    def compress(self, x, ctx=None):
        x = self._input(x)
        idx = self.indices()
        return pack_records(idx, x[idx], self.index_dtype)

    def _records(self, payload):
        idx, values = unpack_records(self._payload(payload), self.index_dtype, self.torch_dtype,
                                     type(self).__name__)
        if idx.numel() and bool(((idx < 0) | (idx >= self.n)).any()):
            raise ValueError(f"{type(self).__name__}: index out of range")
        return idx, values

    def decompress(self, payload, out=None):
        idx, values = self._records(payload)
        out = self._output(out)
        out.zero_()
        out[idx] = values
        return out

    def decompress_add(self, payload, acc):
        idx, values = self._records(payload)
        acc = self._inplace(acc, "acc")
        acc[idx] += values  # gathers, adds, scatters: a repeated index counts once, as numpy

    def residual(self, payload, x):
        idx, values = self._records(payload)
        x = self._inplace(x, "x")
        x[idx] -= values
