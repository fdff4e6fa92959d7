"""topk on the device, and the (index, value) records that topk and randomk share
(compress/sparse.py): k packed records of (uint32 index, value) for float32 and float16
(6 bytes: we differ from BytePS's uint16 indices there), (uint64, float64) for float64.

topk selects exactly the numpy codec's set: the k largest |x| compared as IEEE bit patterns
(NaN above inf above every finite value), ties to the lower index. Its records go out in
ascending index order. The numpy codec's order is whatever its quickselect leaves (the format
says "any order", and BytePS sent heap order), so the two payloads hold the same records and
decode, sum and feed back identically, but their bytes are equal only after sorting the records
by index. randomk lives in randomk.py (another file) and reuses ``DeviceSparseCodec``.
"""
import numpy as np
import torch

from ..sparse import RECORD, TopK, resolve_k
from .base import DeviceCodec
from .registry import register_device_compressor

# element dtype -> (torch index dtype, its bytes, torch integer type of the element's bits, abs mask)
LAYOUT = {np.dtype(np.float32): (torch.int32, 4, torch.int32, 0x7FFFFFFF),
          np.dtype(np.float16): (torch.int32, 4, torch.int16, 0x7FFF),
          np.dtype(np.float64): (torch.int64, 8, torch.int64, 0x7FFFFFFFFFFFFFFF)}


def magnitude_keys(x):
    """|x| as its IEEE bit pattern (an integer tensor that orders like |x|, NaN above inf)."""
    _, _, bits, mask = LAYOUT[np.dtype(str(x.dtype).removeprefix("torch."))]
    keys = x.view(bits) & mask
    return keys.to(torch.int32) if bits == torch.int16 else keys


def pack_records(idx, values, index_dtype):
    """k records (index as ``index_dtype``, value), packed little-endian, as a flat uint8 tensor."""
    k = idx.numel()
    index_bytes = idx.to(index_dtype).view(torch.uint8).view(k, torch.iinfo(index_dtype).bits // 8)
    value_bytes = values.contiguous().view(torch.uint8).view(k, values.element_size())
    return torch.cat([index_bytes, value_bytes], 1).view(-1)


def aligned(columns):
    """A fresh contiguous copy of byte columns, so that it can be viewed as a wider type."""
    out = torch.empty(columns.shape, dtype=torch.uint8, device=columns.device)
    out.copy_(columns)
    return out


def unpack_records(buf, index_dtype, value_dtype, what):
    """(indices as int64, values) of a flat uint8 tensor of packed records."""
    index_bytes = torch.iinfo(index_dtype).bits // 8
    value_bytes = torch.finfo(value_dtype).bits // 8
    size = index_bytes + value_bytes
    if buf.numel() % size:
        raise ValueError(f"{what}: payload of {buf.numel()} bytes is not a whole number of "
                         f"{size}-byte records")
    rec = buf.view(-1, size)
    idx = aligned(rec[:, :index_bytes]).view(index_dtype).view(-1)
    if index_dtype == torch.int32:  # uint32 on the wire: keep indices >= 2^31 out of range
        idx = idx.to(torch.int64) & 0xFFFFFFFF
    values = aligned(rec[:, index_bytes:]).view(value_dtype).view(-1)
    return idx, values


class DeviceSparseCodec(DeviceCodec):
    """Shared payload handling of topk and randomk; subclasses choose the indices."""

    def __init__(self, params, n, dtype, seed=None, device=None):
        super().__init__(params, n, dtype, seed, device)
        if self.dtype not in LAYOUT:
            raise TypeError(f"{type(self).__name__}: unsupported dtype {self.dtype}")
        self.k = resolve_k(params.k, self.n)
        self.record_bytes = RECORD[self.dtype.type].itemsize
        self.index_dtype = LAYOUT[self.dtype][0]

    def indices(self, x):
        """The k chosen positions of x (a flat tensor on the device), as an integer tensor."""
        raise NotImplementedError

    def compress(self, x, ctx=None):
        x = self._input(x)
        idx = self.indices(x)
        return pack_records(idx, x[idx], self.index_dtype)

    def records(self, payload):
        """(indices, values) of a payload, every index checked to be below n."""
        idx, values = unpack_records(self._payload(payload), self.index_dtype, self.torch_dtype,
                                     type(self).__name__)
        if idx.numel() and bool(((idx < 0) | (idx >= self.n)).any()):
            raise ValueError(f"{type(self).__name__}: index out of range")
        return idx, values

    def decompress(self, payload, out=None):
        idx, values = self.records(payload)
        out = self._output(out)
        out.zero_()
        out[idx] = values
        return out

    def decompress_add(self, payload, acc):
        # only the sent positions change; a repeated index counts once, like numpy's acc[i] += v
        acc = self._inplace(acc, "acc")
        idx, values = self.records(payload)
        acc[idx] += values

    def residual(self, payload, x):
        x = self._inplace(x, "x")
        idx, values = self.records(payload)
        x[idx] -= values


def select_top(keys, k):
    """Mask of the k largest keys, ties to the lower index: every key above the k-th largest,
    then the equal ones of lowest index (a selection's tie order is unspecified: this is not)."""
    kth = torch.topk(keys, k, sorted=False).values.min()
    above = keys > kth
    tied = keys == kth
    return above | (tied & (torch.cumsum(tied, 0) <= k - above.sum()))


@register_device_compressor("topk")
class DeviceTopK(DeviceSparseCodec):
    """The k elements of largest magnitude, ties to the lower index, in ascending index order.

    As the C kernel does, a strided sample estimates a key a little below the k-th largest;
    one pass keeps the elements at or above it, and the exact selection runs on those few (a
    set holding at least k elements with every key above its smallest holds the top k). When
    the estimate keeps fewer than k, or far too many, the selection runs on everything."""
    reducers = TopK.reducers

    def indices(self, x):
        keys = magnitude_keys(x)
        if self.k == self.n:
            return torch.arange(self.n, device=self.device)
        if self.k * 16 < self.n:
            size = min(32 * self.n // self.k, self.n // 4)  # ~32 hits above the k-th key
            sample = keys[:: self.n // size][:size]
            rank = min(2 * (self.k * size // self.n) + 16, size)  # twice the hits, and slack
            floor = torch.topk(sample, rank, sorted=False).values.min()
            kept = keys >= floor
            count = int(kept.sum())  # one sync: how many candidates
            if int(floor) > 0 and self.k <= count <= 6 * self.k + 1024:
                candidates = torch.nonzero(kept).view(-1)  # ascending, so ties stay in order
                return candidates[select_top(keys[candidates], self.k)]
        return torch.nonzero(select_top(keys, self.k)).view(-1)
