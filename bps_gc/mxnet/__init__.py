"""The MXNet (Gluon) binding, with BytePS's API: a BytePS gluon script runs after changing
``import byteps.mxnet as bps`` to ``import bps_gc.mxnet as bps``.

    import bps_gc.mxnet as bps
    bps.init()
    bps.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     compression_params={"compressor": "onebit", "ef": "vanilla"})

After this import, ``import gluoncv`` works beside torch >= 2 (see gluoncv_compat.py).
CPU NDArrays go to the worker core as zero-copy numpy views of their memory; push_pull works
in place.
"""
import itertools

import mxnet as mx

from .. import core
from ..core import NodeFailure, local_rank, local_size, metrics, rank, shutdown, size
from . import gluoncv_compat
from .tensors import HostArray
from .trainer import DistributedTrainer

# BytePS's gluon scripts import gluoncv, whose own torch check fails beside torch >= 2
gluoncv_compat.install()

__all__ = ["DistributedTrainer", "NodeFailure", "broadcast_parameters", "byteps_declare_tensor",
           "byteps_push_pull", "init", "local_rank", "local_size", "metrics", "rank",
           "shutdown", "size"]

_unnamed = itertools.count()


def init(lazy=True, config=None):
    """Join the cluster the environment describes (``lazy`` is accepted for BytePS's API)."""
    return core.init(config)


def _require_init(what):
    if not core.is_initialized():
        raise RuntimeError(f"bps_gc.mxnet.{what}: bps_gc is not initialized; call bps.init() first")


def byteps_declare_tensor(name, **kwargs):
    """Declare ``name`` with BytePS's ``byteps_*`` string kwargs or friendly keys
    (``compressor``, ``k``, ...); ``shape``/``dtype`` may be given to place it now."""
    _require_init("byteps_declare_tensor")
    core.declare(name, **kwargs)


def byteps_push_pull(tensor, version=0, priority=0, name=None, is_average=True):
    """Sum (or average) an NDArray over all workers, in place; returns when it is done.
    An undeclared ``name`` is declared uncompressed; without a name one is made from a counter
    (the same on every worker only if all call in the same order). ``version`` is ignored."""
    _require_init("byteps_push_pull")
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"byteps_push_pull: expected an mxnet NDArray, got {type(tensor).__name__}")
    if name is None:
        name = f"byteps.push_pull.noname.{next(_unnamed)}"
    if core.declaration(name) is None:
        core.declare(name, shape=tensor.shape, dtype=tensor.dtype)
    host = HostArray(tensor, write=True)
    core.push_pull(host.array, name, average=is_average, priority=priority).wait()
    host.commit()
    return tensor


def broadcast_parameters(params, root_rank=0):
    """Every worker ends with ``root_rank``'s values: ``params`` is a ParameterDict or a dict of
    name -> Parameter or NDArray, handled in sorted name order. Parameters whose initialization
    is still deferred are skipped (DistributedTrainer broadcasts them at its first step)."""
    _require_init("broadcast_parameters")
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise TypeError("broadcast_parameters: params must be a ParameterDict or a dict of "
                        f"name -> Parameter/NDArray, got {type(params).__name__}")
    for name, value in sorted(params.items(), key=lambda item: item[0]):
        if isinstance(value, mx.gluon.Parameter):
            try:
                arrays = value.list_data()
            except mx.gluon.parameter.DeferredInitializationError:
                continue
        elif isinstance(value, mx.nd.NDArray):
            arrays = [value]
        else:
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(value).__name__}, "
                            "not a Parameter or NDArray")
        host = HostArray(arrays[0], write=True)
        core.broadcast(host.array, root_rank, name=f"mxnet.{name}")
        host.commit()
        for other in arrays[1:]:
            arrays[0].copyto(other)
    for value in params.values():
        if isinstance(value, mx.nd.NDArray):
            value.wait_to_read()
