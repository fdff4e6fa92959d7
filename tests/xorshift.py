"""xorshift128+, the generator of randomk and dithering (a Python mirror of the C one)."""
import numpy as np

from bps_gc.compress._native import lib, ptr

MASK64 = (1 << 64) - 1


class XorShift128Plus:
    def __init__(self, seed):
        if not 0 < int(seed) < 2**64:
            raise ValueError(f"seed must be in [1, 2**64), got {seed!r}")
        self.a = self.b = int(seed)

    def next(self):
        t, s = self.a, self.b
        self.a = s
        t ^= (t << 23) & MASK64
        t ^= t >> 17
        t ^= s ^ (s >> 26)
        self.b = t
        return (t + s) & MASK64

    def randint(self, lo, hi):
        return self.next() % (hi - lo) + lo

    def bernoulli(self, p):
        return float(self.next()) < p * 2.0**64


def native_outputs(seed, count):
    """The first ``count`` outputs of the C generator (to check it against this one)."""
    state = np.array([seed, seed], np.uint64)
    out = np.empty(count, np.uint64)
    lib.rng_fill(ptr(state), count, ptr(out))
    return out
