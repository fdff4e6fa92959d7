"""threshold and adaptive_threshold on the device, and the sorted (uint32 index, value) records
they share with DGC (compress/threshold.py): every element whose |x| bit pattern is at least
the threshold's (NaN and inf above every finite threshold), in ascending index order, so the
payloads are byte-identical to the numpy codecs'. ``DeviceSortedSparse`` is the base a device
DGC reuses (``value_dtype`` float16 for its ``fp16_values``)."""
import numpy as np
import torch

from ..threshold import AdaptiveThreshold, SortedSparse, Threshold
from .base import DeviceCodec
from .registry import register_device_compressor
from .sparse import magnitude_keys, pack_records, unpack_records

TORCH_VALUES = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


class DeviceSortedSparse(DeviceCodec):
    """Float32 or float16 partitions sent as sorted (index, value) records of ``value_dtype``."""

    def __init__(self, params, n, dtype, seed=None, device=None, value_dtype=None):
        super().__init__(params, n, dtype, seed, device)
        # the numpy codec checks the dtypes and computes the thresholds' keys
        self.host = SortedSparse(params, n, dtype, value_dtype)
        self.value_dtype = TORCH_VALUES[self.host.value_dtype]

    def collect(self, x, threshold_key):
        """Indices (ascending, int64) of the elements of x whose |x| key >= threshold_key."""
        return torch.nonzero(magnitude_keys(x) >= int(threshold_key)).view(-1)

    def encode(self, x, idx):
        return pack_records(idx, x[idx].to(self.value_dtype), torch.int32)

    def records(self, payload):
        """(indices, values) of a payload; indices must increase strictly and stay below n."""
        buf = self._payload(payload)
        idx, values = unpack_records(buf, torch.int32, self.value_dtype, type(self).__name__)
        if idx.numel() > self.n:
            raise ValueError(f"{type(self).__name__}: payload of {buf.numel()} bytes holds more "
                             f"than {self.n} records")
        if idx.numel():
            bad = idx[-1] >= self.n
            if idx.numel() > 1:
                bad = bad | (idx[1:] <= idx[:-1]).any()
            if bool(bad):
                raise ValueError(f"{type(self).__name__}: indices must increase strictly and stay "
                                 f"below {self.n}")
        return idx, values.to(self.torch_dtype)

    def decompress(self, payload, out=None):
        idx, values = self.records(payload)
        out = self._output(out)
        out.zero_()
        if self.dtype == np.float32:
            out[idx] = values  # the C kernel assigns: a -0.0 value stays -0.0
        else:
            out[idx] += values  # numpy adds to the zeros: -0.0 becomes +0.0
        return out

    def decompress_add(self, payload, acc):
        acc = self._inplace(acc, "acc")
        idx, values = self.records(payload)
        acc[idx] += values

    def residual(self, payload, x):
        x = self._inplace(x, "x")
        idx, values = self.records(payload)
        x[idx] -= values


@register_device_compressor("threshold")
class DeviceThreshold(DeviceSortedSparse):
    """Every element with |x| >= v (v rounded to float32; NaN and inf always kept)."""
    reducers = Threshold.reducers

    def __init__(self, params, n, dtype, seed=None, device=None):
        super().__init__(params, n, dtype, seed, device)
        self.key = self.host.threshold_key(params.option("threshold"))

    def compress(self, x, ctx=None):
        x = self._input(x)
        return self.encode(x, self.collect(x, self.key))


@register_device_compressor("adaptive_threshold")
class DeviceAdaptiveThreshold(DeviceSortedSparse):
    """Every element with |x| >= max|x| / 2 (halved in the partition's dtype); nothing when x is
    all zeros."""
    reducers = AdaptiveThreshold.reducers

    def compress(self, x, ctx=None):
        x = self._input(x)
        keys = magnitude_keys(x)
        top = int(keys.max())
        if top == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        key_type = np.uint32 if self.dtype == np.float32 else np.uint16
        peak = np.array([top], key_type).view(self.dtype)[0]
        half = self.dtype.type(peak) / self.dtype.type(2)
        key = self.host.threshold_key(half if np.isfinite(peak) else np.inf)
        return self.encode(x, torch.nonzero(keys >= key).view(-1))
