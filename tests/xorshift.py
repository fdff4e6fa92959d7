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


def splitmix(value):
    """One splitmix64 output after ``value`` (0 read as 1, as a seed must not be 0)."""
    z = (int(value) + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) or 1


def mixed_state(seed):
    """xorshift128+ state for our own codecs: the seed goes through splitmix64 first (two
    outputs, one per state word). Seeded raw, as BytePS does (a = b = seed), small seeds give
    nearly the same first draws; BytePS's codecs keep that for byte-exactness, ours do not."""
    if not 0 < int(seed) < 2**64:
        raise ValueError(f"seed must be in [1, 2**64), got {seed!r}")
    return np.array([splitmix(seed), splitmix((int(seed) + 0x9E3779B97F4A7C15) & MASK64)], np.uint64)


def worker_seed(seed, key, rank):
    """thc's rounding seed as docs/codecs.md states it: the seed, then the key, then the rank,
    each folded in as seed = splitmix(seed xor splitmix(value))."""
    for value in (key, rank):
        seed = splitmix(int(seed) ^ splitmix(value))
    return seed
