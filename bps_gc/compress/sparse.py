"""topk and randomk: k (index, value) records, 32-bit indices (64-bit for float64)."""
import logging

import numpy as np

from ._native import check, lib, ptr
from .base import Codec
from .registry import register_compressor

log = logging.getLogger(__name__)
RECORD = {
    np.float32: np.dtype([("i", "<u4"), ("v", "<f4")]),
    np.float64: np.dtype([("i", "<u8"), ("v", "<f8")]),
    np.float16: np.dtype([("i", "<u4"), ("v", "<f2")]),  # we differ: BytePS used uint16 indices
}
_clamped = set()


def resolve_k(k, n):
    """k < 1: that fraction of n rounded up to 32 (at least 1); k >= 1: a count.
    We differ from BytePS, which aborted when k > n/2: clamp to max(1, n // 2)."""
    count = max(1, int(k * (-(-n // 32) * 32))) if k < 1 else int(k)
    limit = max(1, n // 2)
    if count > limit:
        if (k, n) not in _clamped:
            _clamped.add((k, n))
            log.debug("k=%s selects %d of %d elements; clamped to %d", k, count, n, limit)
        count = limit
    return count


class SparseCodec(Codec):
    """Shared payload handling; subclasses choose the indices."""

    def __init__(self, params, n, dtype):
        super().__init__(params, n, dtype)
        self.k = resolve_k(params.k, self.n)
        self.record = RECORD[self.dtype.type]
        self._native = None if self.dtype == np.float16 else (
            getattr(lib, "records_gather_" + ("f32" if self.dtype == np.float32 else "f64")),
            getattr(lib, "records_scatter_" + ("f32" if self.dtype == np.float32 else "f64")))

    def indices(self, x):
        """uint32 array of the k chosen positions of x (x is contiguous, of self.dtype)."""
        raise NotImplementedError

    def compress(self, x, ctx=None):
        x = self._input(x)
        idx = self.indices(x)
        rec = np.empty(self.k, self.record)
        if self._native:
            self._native[0](ptr(x), ptr(idx), self.k, ptr(rec))
        else:
            rec["i"], rec["v"] = idx, x[idx]
        return rec.view(np.uint8)

    def _records(self, payload):
        buf = self._payload(payload)
        if buf.size % self.record.itemsize:
            raise ValueError(f"{type(self).__name__}: payload of {buf.size} bytes is not a whole "
                             f"number of {self.record.itemsize}-byte records")
        return np.frombuffer(np.ascontiguousarray(buf), self.record)

    def decompress(self, payload, out=None):
        rec = self._records(payload)
        out = self._output(out)
        if self._native:
            check(self._native[1](ptr(rec), rec.size, self.n, ptr(out)), type(self).__name__)
        else:
            if rec.size and int(rec["i"].max()) >= self.n:
                raise ValueError(f"{type(self).__name__}: index out of range")
            out[:] = 0
            out[rec["i"]] = rec["v"]
        return out

    def decompress_add(self, payload, acc):
        # O(k): only the sent positions change; a repeated index counts once, like decompress
        rec = self._records(payload)
        if rec.size and int(rec["i"].max()) >= self.n:
            raise ValueError(f"{type(self).__name__}: index out of range")
        acc[rec["i"]] += rec["v"]

    def residual(self, payload, x):
        # O(k): only the sent positions change; a repeated index is applied once, like decompress
        rec = self._records(payload)
        x[rec["i"]] -= rec["v"]


@register_compressor("topk")
class TopK(SparseCodec):
    """The k elements of largest magnitude; ties go to the lower index."""

    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)
        self._select = lib.topk_indices_f64 if self.dtype == np.float64 else lib.topk_indices_f32

    def indices(self, x):
        if self.dtype == np.float16:
            x = x.astype(np.float32)  # exact, and orders the same
        idx = np.empty(self.k, np.uint32)
        check(self._select(ptr(x), self.n, self.k, ptr(idx)), "topk")
        return idx


@register_compressor("randomk")
class RandomK(SparseCodec):
    """k positions drawn with replacement from xorshift128+ (state carried across steps)."""

    state_attrs = ("rng_state",)

    def __init__(self, params, n, dtype, seed):
        super().__init__(params, n, dtype)
        self.rng_state = np.array([seed, seed], np.uint64)
        self._state = ptr(self.rng_state)  # the array lives as long as the codec
        self._draw_records = None if self.dtype == np.float16 else getattr(
            lib, "randomk_records_" + ("f32" if self.dtype == np.float32 else "f64"))

    def compress(self, x, ctx=None):
        # one kernel call draws and gathers: at 0.1% of 1M elements the Python around it is
        # most of the cost, so it is kept to the minimum
        if self._draw_records is None:
            return super().compress(x, ctx)
        x = self._input(x)
        out = np.empty(self.k * self.record.itemsize, np.uint8)
        self._draw_records(self._state, ptr(x), self.n, self.k, ptr(out))
        return out

    def indices(self, x):
        idx = np.empty(self.k, np.uint32)
        lib.randomk_indices(ptr(self.rng_state), self.n, self.k, ptr(idx))
        return idx
