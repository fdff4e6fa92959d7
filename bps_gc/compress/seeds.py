"""Seeds every process derives alike from a partition key, and our codecs' generator state."""
import numpy as np

MASK64 = (1 << 64) - 1


def derive_seed(key):
    """A non-zero seed every process computes alike from the partition key (splitmix64).
    BytePS drew a random seed per process, so servers sampled other indices than workers."""
    z = (int(key) + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) or 1


def mixed_state(seed):
    """xorshift128+ state for our own codecs: two splitmix64 outputs of the seed. BytePS seeds
    raw (a = b = seed), so small seeds give nearly the same first draws; its codecs keep that
    for byte-exactness, ours do not."""
    if not 0 < int(seed) < 2**64:
        raise ValueError(f"seed must be in [1, 2**64), got {seed!r}")
    return np.array([derive_seed(seed), derive_seed((int(seed) + 0x9E3779B97F4A7C15) & MASK64)],
                    np.uint64)


def worker_seed(seed, key, rank):
    """The seed of one worker's own draws for one partition (thc's stochastic rounding): the
    chain's seed, the partition key and the worker's rank folded through splitmix64, so every
    launch repeats them, while two ranks (or two partitions under one ``seed``) draw apart."""
    for value in (key, rank):
        seed = derive_seed(int(seed) ^ derive_seed(value))
    return seed
