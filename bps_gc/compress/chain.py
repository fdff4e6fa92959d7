"""Builds the codec chain for one partition from validated parameters."""
import importlib

from .params import CompressionParams
from .registry import COMPRESSORS, ERROR_FEEDBACKS, MOMENTUMS, load_plugins
from .seeds import derive_seed, worker_seed

# granularity -> the codec class of a worker's partition of a tensor cut from one whole-model
# vector; entire_model.py registers ``entiremodel`` when the package loads (it builds its own
# chains with build_chain, so this module cannot import it)
SLICE_CODECS = {}

# compress/device registers its chain builder here once it has loaded (register_device_chains). It
# imports torch, so build_chain loads it by name only when a chain is asked for on a device; it
# builds its host-bridged chains with build_chain, so this module cannot import it
DEVICE_PACKAGE = f"{__package__}.device"
_device_chains = None


def register_device_chains(builder):
    """``builder(params, n, dtype, key, role, shape, device)`` becomes what ``build_chain`` returns
    when it is given a device (compress/device/registry.py's ``build_device_chain``)."""
    global _device_chains
    _device_chains = builder


def compressor_inputs(cls, params, key, shape, rank):
    """(seed, extra keyword arguments) of compressor class ``cls`` for one partition: the seed
    is ``params.seed`` or ``derive_seed(key)``; ``shape`` goes to a class with ``takes_shape``
    (it views its partition as a matrix), and ``worker_seed`` (that seed, the key and ``rank``
    folded together) to one with ``draws_per_worker`` (each worker's own draws)."""
    seed = params.seed if params.seed is not None else derive_seed(key)
    extra = {"shape": tuple(shape)} if shape is not None and getattr(cls, "takes_shape", False) else {}
    if getattr(cls, "draws_per_worker", False):
        extra["worker_seed"] = worker_seed(seed, key, rank)
    return seed, extra


def build_chain(params, n, dtype, key=0, role="worker", shape=None, device=None, rank=0):
    """Codec object for one partition: [momentum ->] [error feedback ->] compressor.

    ``role`` is "worker" or "server"; servers never apply momentum (codecs.md). A worker's
    partition of an ``entiremodel`` tensor gets the chunk codec of compress/entire_model.py.
    With ``device`` (a torch.device or a string such as "cuda:0") the chain runs torch
    operations on that device, with the same payloads (compress/device/; imports torch).
    ``rank``: the worker's, which seeds the draws that must differ between workers (thc's
    rounding); every other draw derives from the key alone, alike on every rank.
    """
    if not isinstance(params, CompressionParams):
        params = CompressionParams.from_dict(params)
    if role not in ("worker", "server"):
        raise ValueError(f"role must be 'worker' or 'server', got {role!r}")
    if not params.compressed:
        raise ValueError("build_chain: these parameters compress nothing (no 'compressor')")
    load_plugins()
    if device is not None:
        if _device_chains is None:
            importlib.import_module(DEVICE_PACKAGE)  # registers its builder; the only torch in compress
        return _device_chains(params, n, dtype, key, role, shape, device, rank)
    if params.granularity in SLICE_CODECS and role == "worker":
        return SLICE_CODECS[params.granularity](params, n, dtype, key)
    cls = COMPRESSORS[params.compressor]
    seed, extra = compressor_inputs(cls, params, key, shape, rank)
    codec = cls(params, n, dtype, seed=seed, **extra)
    if params.ef:
        codec = ERROR_FEEDBACKS[params.ef](codec, params)
    if params.momentum and role == "worker" and not getattr(codec, "owns_momentum", False):
        codec = MOMENTUMS[params.momentum](codec, params)
    return codec
