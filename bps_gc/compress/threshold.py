"""threshold (keep |x| >= v), adaptive_threshold (keep |x| >= max|x|/2), and the payload they
share with DGC: records (uint32 index, value) in strictly increasing index order, no header;
values float32, or float16 for float16 partitions (and DGC's ``fp16_values``)."""
import numpy as np

from ._native import check, lib, ptr
from .base import Codec
from .params import CODEC_OPTIONS
from .registry import register_compressor

RECORDS = {np.dtype(np.float32): np.dtype([("i", "<u4"), ("v", "<f4")]),
           np.dtype(np.float16): np.dtype([("i", "<u4"), ("v", "<f2")])}
KEYS = {np.dtype(np.float32): (np.uint32, "u32"), np.dtype(np.float16): (np.uint16, "u16")}


class SortedSparse(Codec):
    """Float32 or float16 partitions sent as sorted (index, value) records of ``value_dtype``."""

    def __init__(self, params, n, dtype, value_dtype=None):
        super().__init__(params, n, dtype)
        if self.dtype not in KEYS:
            raise TypeError(f"{type(self).__name__}: float32 or float16 partitions only, got {self.dtype}")
        self.value_dtype = np.dtype(value_dtype or self.dtype)
        self.record = RECORDS[self.value_dtype]
        self._key_type = KEYS[self.dtype][0]
        self._key_max = getattr(lib, "key_max_" + KEYS[self.dtype][1])

    def collect(self, x, threshold_key, cap=None):
        """(count, indices): how many elements of x (float32 or float16) have |x| bits >=
        threshold_key (|x| >= a threshold; NaN and inf above every finite threshold), and the
        first ``cap`` of their indices, ascending."""
        cap = self.n if cap is None else cap
        idx = np.empty(max(cap, 1), np.uint32)
        collect = lib.key_collect_u32 if x.dtype == np.float32 else lib.key_collect_u16
        count = collect(ptr(x), self.n, int(threshold_key), ptr(idx), cap)
        return count, idx[: min(count, cap)]

    def encode(self, x, idx):
        rec = np.empty(idx.size, self.record)
        if self.record.itemsize == 8 and x.dtype == np.float32:
            lib.records_gather_u32_f32(ptr(x), ptr(idx), idx.size, ptr(rec))
        else:
            rec["i"] = idx
            rec["v"] = x[idx]
        return rec.view(np.uint8)

    def records(self, payload):
        buf = self._payload(payload)
        if buf.size % self.record.itemsize or buf.size // self.record.itemsize > self.n:
            raise ValueError(f"{type(self).__name__}: payload of {buf.size} bytes is not a whole "
                             f"number of {self.record.itemsize}-byte records, at most {self.n}")
        return buf

    def _scatter(self, payload, out, zero_first):
        buf = self.records(payload)
        if self.record.itemsize == 8 and out.dtype == np.float32:
            buf = np.ascontiguousarray(buf)
            check(lib.sorted_records_add_f32(ptr(buf), buf.size // 8, self.n, ptr(out),
                                             int(zero_first)), type(self).__name__)
            return out
        rec = np.frombuffer(buf.tobytes(), self.record)
        idx = rec["i"].astype(np.int64)
        if idx.size and (idx[-1] >= self.n or (idx.size > 1 and np.any(idx[1:] <= idx[:-1]))):
            raise ValueError(f"{type(self).__name__}: indices must increase strictly and stay "
                             f"below {self.n}")
        if zero_first:
            out[:] = 0
        out[idx] += rec["v"].astype(out.dtype)
        return out

    def decompress(self, payload, out=None):
        return self._scatter(payload, self._output(out), True)

    def decompress_add(self, payload, acc):
        self._scatter(payload, self._output(acc), False)

    def residual(self, payload, x):
        rec = np.frombuffer(self.records(payload).tobytes(), self.record)
        x[rec["i"].astype(np.int64)] -= rec["v"].astype(x.dtype)

    def threshold_key(self, value):
        """The smallest key whose float is >= value (value >= 0, a float32 number)."""
        with np.errstate(over="ignore"):  # beyond float16: inf, which only inf and NaN reach
            t = self.dtype.type(value)
        if float(t) < float(np.float32(value)) and np.isfinite(t):
            t = np.nextafter(t, self.dtype.type(np.inf))
        return int(np.array([t], self.dtype).view(self._key_type)[0])


@register_compressor("threshold", options=CODEC_OPTIONS["threshold"])
class Threshold(SortedSparse):
    """Every element with |x| >= v (v rounded to float32; NaN and inf are always kept, so a
    non-finite gradient shows up in the result)."""

    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)
        self.key = self.threshold_key(params.option("threshold"))

    def compress(self, x, ctx=None):
        x = self._input(x)
        _, idx = self.collect(x, self.key)
        return self.encode(x, idx)


@register_compressor("adaptive_threshold")
class AdaptiveThreshold(SortedSparse):
    """Every element with |x| >= max|x| / 2; nothing when x is all zeros."""

    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)

    def compress(self, x, ctx=None):
        x = self._input(x)
        top = self._key_max(ptr(x), self.n)
        if top == 0:
            return np.empty(0, np.uint8)
        peak = np.array([top], self._key_type).view(self.dtype)[0]
        half = self.dtype.type(peak) / self.dtype.type(2)
        # non-finite: every inf and NaN (their keys are at least inf's)
        key = self.threshold_key(half if np.isfinite(peak) else np.inf)
        _, idx = self.collect(x, key)
        return self.encode(x, idx)
