"""Builds the codec chain for one partition from validated parameters."""
import numpy as np

from .params import CompressionParams
from .registry import COMPRESSORS, ERROR_FEEDBACKS, MOMENTUMS, load_plugins

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


def build_chain(params, n, dtype, key=0, role="worker", shape=None, device=None):
    """Codec object for one partition: [momentum ->] [error feedback ->] compressor.

    ``role`` is "worker" or "server"; servers never apply momentum (codecs.md). A worker's
    partition of an ``entiremodel`` tensor gets the chunk codec of compress/entiremodel.py.
    With ``device`` (a torch.device or a string such as "cuda:0") the chain runs torch
    operations on that device, with the same payloads (compress/device/; imports torch).
    """
    if not isinstance(params, CompressionParams):
        params = CompressionParams.from_dict(params)
    if role not in ("worker", "server"):
        raise ValueError(f"role must be 'worker' or 'server', got {role!r}")
    if not params.compressed:
        raise ValueError("build_chain: these parameters compress nothing (no 'compressor')")
    load_plugins()
    if device is not None:
        from .device import build_device_chain  # the only import of torch in compress
        return build_device_chain(params, n, dtype, key, role, shape, device)
    if params.granularity == "entiremodel" and role == "worker":
        from .entiremodel import EntireModelSlice  # its codecs import this module
        return EntireModelSlice(params, n, dtype, key)
    seed = params.seed if params.seed is not None else derive_seed(key)
    cls = COMPRESSORS[params.compressor]
    # ``shape``, the whole tensor's, goes to a compressor that views its partition as a matrix
    extra = {"shape": tuple(shape)} if shape is not None and getattr(cls, "takes_shape", False) else {}
    codec = cls(params, n, dtype, seed=seed, **extra)
    if params.ef:
        codec = ERROR_FEEDBACKS[params.ef](codec, params)
    if params.momentum and role == "worker" and not getattr(codec, "owns_momentum", False):
        codec = MOMENTUMS[params.momentum](codec, params)
    return codec
