"""Deep Gradient Compression on the device: compress/dgc.py's algorithm and payload (sorted
records, uint32 index and float32 or float16 value), with u (momentum) and v (accumulated
update) kept as float32 tensors on the device.

Everything but one number per step is deterministic, and so is the payload: the same bytes and
the same u and v as the numpy chain. The one random number is the sampling start (an offset in
[0, stride)), drawn on the host from the numpy chain's xorshift128+ state; it is one draw per
step, so the host costs nothing and the two chains stay step for step alike. The threshold
adaptation needs the count of selected elements on the host each round (as DGC's reference
code); those counts are the only device-to-host reads besides the all-finite check.
"""
import math

import numpy as np
import torch

from .._native import lib, ptr
from ..context import step_context
from ..dgc import CANDIDATES, LOWER, NONFINITE_KEY, ROUNDS, UPPER, read_settings, sampling_plan, step_density
from ..seeds import mixed_state
from .registry import register_device_compressor
from .sparse import magnitude_keys
from .threshold import DeviceSortedSparse

ABS_BITS = 0x7FFFFFFF  # |x| of a float32 as its bits: the sign bit cleared


@register_device_compressor("dgc")
class DeviceDGC(DeviceSortedSparse):
    owns_momentum = True  # as the numpy codec: build_chain adds no momentum decorator
    reducers = ("lossless",)
    state_attrs = ("u", "v", "rng_state")  # as the numpy codec's; rng_state on the host

    def __init__(self, params, n, dtype, seed, device, **extra):
        options = dict(params.options)
        fp16 = options.get("fp16_values", False) or np.dtype(dtype) == np.float16
        super().__init__(params, n, dtype, seed, device, np.float16 if fp16 else np.float32)
        read_settings(self, params, options)
        zeros = dict(dtype=torch.float32, device=self.device)
        self.u = torch.zeros(self.n, **zeros) if self.mu else None
        self.v = torch.zeros(self.n, **zeros)
        self.rng_state = mixed_state(seed)
        self._plans = {}
        self.last = {}

    def density(self, ctx):
        return step_density(self, ctx)

    def compress(self, x, ctx=None):
        ctx = step_context(ctx)
        g = self._input(x).to(torch.float32)
        if self.clip_norm is not None:
            # the squared norm in float64, as the numpy codec (in another order: the last bit
            # of the clipping coefficient may differ)
            norm = math.sqrt(float((g.to(torch.float64) ** 2).sum()))
            coef = self.clip_norm / math.sqrt(float(ctx.get("workers", 1))) / (norm + 1e-6)
            if coef < 1:
                g = g * np.float32(coef).item()
        if not bool(torch.isfinite(g).all()):
            # the round's result shows it; u and v keep the state of the last good step
            return self.encode(g, self.collect(g, NONFINITE_KEY))
        if self.u is None:
            self.v += g
        elif self.nesterov:  # the kernel's roundings: t = (u + g) mu; v = (v + t) + g
            self.u.add_(g).mul_(self.mu)
            self.v.add_(self.u).add_(g)
        else:  # t = u mu + g; v = v + t
            self.u.mul_(self.mu).add_(g)
            self.v.add_(self.u)
        idx = self.select(self.v, self.density(ctx))
        payload = self.encode(self.v, idx)
        self.v[idx] = 0
        if self.masking and self.u is not None:
            self.u[idx] = 0
        return payload

    # selection (algorithms.md section 2.3), step for step as compress/dgc.py -----------------

    def collect_first(self, x, threshold_key, cap):
        """(count, indices): how many |x| keys are >= threshold_key, and the first ``cap`` of
        their indices, ascending (as the numpy codec's ``collect``)."""
        idx = self.collect(x, threshold_key)
        return idx.numel(), idx[:cap]

    def select(self, v, density):
        if density not in self._plans:
            self._plans[density] = sampling_plan(self.n, density, self.sample_ratio)
        stride, samples, top_k_samples, selects = self._plans[density]
        keys = magnitude_keys(v)
        if samples == self.n:
            start, sample = 0, keys
        else:
            draw = np.empty(1, np.uint64)
            lib.rng_fill(ptr(self.rng_state), 1, ptr(draw))
            start = int(draw[0] % np.uint64(stride))
            sample = keys[start::stride]
        kth = sample.numel() - top_k_samples  # the (kth + 1)-th smallest, as np.partition
        threshold = np.array([int(torch.kthvalue(sample, kth + 1).values)], np.uint32).view(np.float32)[0]
        cap = CANDIDATES * selects
        count, idx = self.collect_first(v, int(threshold.view(np.uint32)), cap)
        rounds, fallback = 0, False
        for _ in range(ROUNDS):
            if count > selects:
                if count > UPPER * selects:
                    idx, fallback = self.exact_top(keys, idx, count, selects), True
                break
            if count >= LOWER * selects:
                break
            threshold = threshold * np.float32(LOWER)
            count, idx = self.collect_first(v, int(threshold.view(np.uint32)), cap)
            rounds += 1
        idx = idx[:selects]
        self.last = {"density": density, "start": start, "threshold": float(threshold),
                     "rounds": rounds, "count": count, "fallback": fallback, "selects": selects}
        return idx

    def exact_top(self, keys, idx, count, selects):
        """Ascending indices of the ``selects`` largest |v|, ties to the lower index: among the
        collected ones when all ``count`` were collected, else among all of v. One int64 sort
        key per element, (largest |v| first, then lowest index), makes the order total."""
        if count > idx.numel():
            idx = torch.arange(self.n, device=self.device)
        order = (ABS_BITS - keys[idx].to(torch.int64)) << 32 | idx
        best = torch.topk(order, selects, largest=False, sorted=False).values & 0xFFFFFFFF
        return best.sort().values
