"""Deep Gradient Compression (Lin et al., ICLR 2018), algorithms.md section 2, per partition.

Momentum correction (plain, or nesterov with ``momentum: nesterov``; the factor is ``mu``),
local clipping, the sampled top-k threshold with its adaptation, momentum factor masking and
the sparsity warm-up. The payload is threshold.py's sorted records: uint32 indices, float32
values (float16 with ``fp16_values`` or for float16 partitions). The state (u: momentum,
v: accumulated update) is float32 whatever the partition's type.

Warm-up: the kept fraction of epoch e < W is ``k ** ((e + 1) / W)`` (the paper's schedule:
25%, 6.3%, 1.6%, 0.4%, 0.1% for W = 5, k = 0.001; DGC's reference code uses (e+1)/(W+1)), or
``warmup_densities[e]``; a step context key ``density`` overrides both.
"""
import math

import numpy as np

from ._native import check, lib, ptr
from .context import step_context
from .params import CODEC_OPTIONS
from .registry import register_compressor
from .seeds import mixed_state
from .threshold import SortedSparse

UPPER, LOWER, ROUNDS = 1.3, 0.8, 10  # DGC's adaptation bounds and its number of rounds
CANDIDATES = 4  # indices collected per selected one: past 1.3x the exact top-k often needs no rescan
NONFINITE_KEY = 0x7F800000  # |x| bits of inf: inf and NaN are at or above it


def sampling_plan(n, density, sample_ratio):
    """(stride, num_samples, top_k_samples, num_selects), exactly as DGC's reference code."""
    pct = int(math.ceil(n * sample_ratio))
    cpr = int(math.ceil(2 / density))
    if n <= cpr:
        stride, samples = 1, n
    else:
        want = max(pct, cpr)
        stride = int(math.ceil(n / want / 32)) * 32 + 1
        samples = n // stride
        while samples < want:
            stride -= 8
            samples = n // stride
    return stride, samples, int(math.ceil(samples * density)), int(math.ceil(n * density))


def warmup_density(final, epoch, warmup_epochs=0, densities=()):
    if densities:
        return densities[epoch] if 0 <= epoch < len(densities) else final
    if warmup_epochs and 0 <= epoch < warmup_epochs:
        return final ** ((epoch + 1) / warmup_epochs)
    return final


def read_settings(codec, params, options):
    """The DGC settings of ``params`` on ``codec`` (the numpy and device chains alike)."""
    codec.final = float(params.k) if params.k < 1 else min(1.0, params.k / codec.n)
    codec.sample_ratio = options.get("sample_ratio", 0.01)
    codec.warmup_epochs = options.get("warmup_epochs", 0)
    codec.warmup_densities = options.get("warmup_densities", ())
    codec.clip_norm = options.get("clip_norm")
    codec.masking = options.get("momentum_masking", True)
    codec.mu = params.mu
    codec.nesterov = params.momentum == "nesterov"


def step_density(codec, ctx):
    """The kept fraction of this step: the step context's ``density`` when it gives one, else
    ``codec``'s warm-up schedule at the context's epoch (the numpy and device chains alike)."""
    if "density" in ctx:
        r = float(ctx["density"])
        if not 0 < r <= 1:
            raise ValueError(f"dgc: step context density must be in (0, 1], got {r!r}")
        return r
    return warmup_density(codec.final, int(ctx["epoch"]), codec.warmup_epochs, codec.warmup_densities)


@register_compressor("dgc", options=CODEC_OPTIONS["dgc"])
class DGC(SortedSparse):
    owns_momentum = True  # build_chain adds no momentum decorator
    reducers = ("lossless",)  # the pull is the exact sum of the sparse pushes
    state_attrs = ("u", "v", "rng_state")  # u is None without momentum (mu = 0)

    def __init__(self, params, n, dtype, seed):
        options = dict(params.options)
        fp16 = options.get("fp16_values", False) or np.dtype(dtype) == np.float16
        super().__init__(params, n, dtype, np.float16 if fp16 else np.float32)
        read_settings(self, params, options)
        self.u = np.zeros(self.n, np.float32) if self.mu else None
        self.v = np.zeros(self.n, np.float32)
        self.rng_state = mixed_state(seed)
        self._plans = {}
        self.last = {}  # how the latest selection went (density, threshold, rounds, fallback)

    def density(self, ctx):
        return step_density(self, ctx)

    def compress(self, x, ctx=None):
        ctx = step_context(ctx)
        g = self._input(x)
        g = g.astype(np.float32) if self.dtype == np.float16 else g
        if self.clip_norm is not None:
            moments = np.empty(2, np.float64)
            lib.moments_f32(ptr(g), self.n, ptr(moments))
            bound = self.clip_norm / math.sqrt(float(ctx.get("workers", 1)))
            coef = bound / (math.sqrt(moments[1]) + 1e-6)  # as torch's clip_grad_norm_
            if coef < 1:
                g = g * np.float32(coef)
        if not lib.all_finite_u32(ptr(g), self.n):
            # the round's result must show it; u and v keep their state of the last good step
            _, idx = self.collect(g, NONFINITE_KEY)
            return self.encode(g, idx)
        if self.u is None:
            self.v += g
        else:
            lib.dgc_accumulate_f32(ptr(g), ptr(self.u), ptr(self.v), self.n, self.mu,
                                   int(self.nesterov))
        idx = self.select(self.v, self.density(ctx))
        payload = self.encode(self.v, idx)
        self.v[idx] = 0
        if self.masking and self.u is not None:
            self.u[idx] = 0
        return payload

    def select(self, v, density):
        """Ascending indices of the kept elements of v (float32), algorithms.md section 2.3."""
        if density not in self._plans:
            self._plans[density] = sampling_plan(self.n, density, self.sample_ratio)
        stride, samples, top_k_samples, selects = self._plans[density]
        keys = v.view(np.uint32)
        if samples == self.n:
            start, sample = 0, keys & np.uint32(0x7FFFFFFF)
        else:
            draw = np.empty(1, np.uint64)
            lib.rng_fill(ptr(self.rng_state), 1, ptr(draw))
            start = int(draw[0] % np.uint64(stride))
            sample = keys[start::stride] & np.uint32(0x7FFFFFFF)  # samples or samples + 1
        kth = sample.size - top_k_samples
        threshold = np.partition(sample, kth)[kth]
        threshold = np.array([threshold], np.uint32).view(np.float32)[0]
        cap = CANDIDATES * selects
        count, idx = self.collect(v, threshold.view(np.uint32), cap)
        rounds, fallback = 0, False
        for _ in range(ROUNDS):
            if count > selects:
                if count > UPPER * selects:  # far too many: the exact top-k of those
                    idx, fallback = self.exact_top(v, idx, count, selects), True
                break
            if count >= LOWER * selects:
                break
            threshold = threshold * np.float32(LOWER)
            count, idx = self.collect(v, threshold.view(np.uint32), cap)
            rounds += 1
        idx = idx[:selects]
        self.last = {"density": density, "start": start, "threshold": float(threshold),
                     "rounds": rounds, "count": count, "fallback": fallback, "selects": selects}
        return idx

    def exact_top(self, v, idx, count, selects):
        """Ascending indices of the ``selects`` largest |v| (ties to the lower index) among
        the ``count`` elements at or above the threshold, of which ``idx`` holds the first
        ones: the same as the top-k of all of v, since those elements include it."""
        if count > idx.size:  # not all collected: the whole array
            out = np.empty(selects, np.uint32)
            check(lib.topk_indices_f32(ptr(v), self.n, selects, ptr(out)), "dgc")
            return np.sort(out)
        keys = v.view(np.uint32)[idx] & np.uint32(0x7FFFFFFF)
        order = (np.uint64(0x7FFFFFFF) - keys.astype(np.uint64)) << np.uint64(32) | idx
        best = np.partition(order, selects - 1)[:selects] & np.uint64(0xFFFFFFFF)
        return np.sort(best).astype(np.uint32)
