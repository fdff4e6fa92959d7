"""DistributedTrainer: a gluon Trainer whose gradients are summed by the parameter servers.

BytePS's semantics: parameters (sorted by name) are declared as ``parameter_<i>`` and, when
they have a gradient, ``gradient_<i>`` with the compression settings. The first ``step``
broadcasts the parameters from ``root_rank``; every ``step`` scales each gradient by
``1 / (batch_size * size())``, push_pulls it as a sum (priority ``-i``, the current learning
rate for error feedback), applies the post-pull momentum / weight-decay adapters, and lets the
optimizer update with ``rescale_grad == 1``.

Beyond BytePS: ``granularity: entiremodel`` reduces the compressed gradients of a step as one
vector (``<prefix>gradient_entiremodel.<c>``, bps_gc.algorithms.entire_model); DGC sends 1-D
gradients dense and keeps weight decay local (bps_gc.algorithms.momentum); ``set_epoch(e)``
sets the step context's epoch (DGC's sparsity warm-up).
"""
import mxnet as mx
import numpy as np

from .. import core
from ..algorithms.entire_model import EntireModel, is_entire_model, one_dtype
from ..algorithms.momentum import MomentumPlan, split_reducer
from ..algorithms.step import binding_context, checked_epoch
from .tensors import HostArray
from . import trainer_state


def known_shape(param):
    """The parameter's shape, or None while deferred initialization leaves it unknown."""
    shape = param.shape
    if shape is None or any(d is None or d <= 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


class DistributedTrainer(mx.gluon.Trainer):
    """``mx.gluon.Trainer`` over bps_gc (no kvstore).

    ``compression_params``: ``compressor``, ``ef``, ``momentum``, ``scaling``, ``k``, ``seed``,
    ``partition``, ``normalize``, ``fp16``, ``granularity``, ``reducer`` (the servers' reducer of
    the compressed gradients; see the README). With ``momentum`` the optimizer's
    momentum (and, for ``onebit``, its ``wd``) moves into the codec chain and the post-pull
    adapters. ``prefix`` (not in BytePS) is put in front of the tensor names, for a second
    trainer over other parameters in the same process.
    """

    def __init__(self, params, optimizer, optimizer_params=None, root_rank=0,
                 compression_params=None, prefix=""):
        if not core.is_initialized():
            raise RuntimeError("bps_gc.mxnet.DistributedTrainer: bps_gc is not initialized; "
                               "call bps.init() first")
        if not isinstance(params, (dict, mx.gluon.ParameterDict)):
            raise TypeError("DistributedTrainer: params must be a ParameterDict or a dict of "
                            "name -> Parameter (e.g. net.collect_params()), got "
                            f"{type(params).__name__}: the tensor names parameter_<i> / "
                            "gradient_<i> follow the sorted parameter names")
        size = core.size()
        if not isinstance(root_rank, int) or not 0 <= root_rank < size:
            raise ValueError(f"DistributedTrainer: root_rank {root_rank!r} outside [0, {size})")
        if compression_params is not None and not isinstance(compression_params, dict):
            raise TypeError("DistributedTrainer: compression_params must be a dict, got "
                            f"{type(compression_params).__name__}")
        compression_params, self._reducer = split_reducer(compression_params)
        optimizer_params = dict(optimizer_params or {})  # never mutate the caller's
        plan, optimizer, optimizer_params = MomentumPlan.from_mxnet(optimizer, optimizer_params,
                                                                    compression_params)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        if len(self._contexts) > 1:
            raise ValueError("DistributedTrainer: parameters live on several contexts "
                             f"{self._contexts}; bps_gc runs one worker process per device "
                             "(bpslaunch starts one per NVIDIA_VISIBLE_DEVICES entry)")
        self.root_rank = root_rank
        self._bps_size = size
        self._plan = plan
        self._prefix = prefix
        self._grad_tensors = {}  # i -> the Declaration of gradient_<i>
        self._adapters = {}  # i -> PostPull or None, made at the first pull
        self._epoch = 0
        self._dgc = compression_params.get("compressor") == "dgc"
        self._entire_params = plan.params.to_dict() if is_entire_model(compression_params) else None
        self._entire = None  # the EntireModel, made at the first step (shapes may be deferred)
        self._in_entire = set()
        for i, param in enumerate(self._params):
            shape = known_shape(param)
            dtype = np.dtype(param.dtype) if shape is not None else None
            self._declare(self._name("parameter", i), shape, dtype, param, {})
            if param.grad_req == "null":
                continue
            ndim = len(param.shape) if param.shape is not None else 2
            compression = plan.tensor_params(ndim)
            if self._entire_params is not None and compression.get("compressor"):
                self._in_entire.add(i)  # declared with the others at the first step
                continue
            compression.pop("granularity", None)
            if compression.get("compressor"):
                compression["reducer"] = self._reducer
            self._grad_tensors[i] = self._declare(self._name("gradient", i), shape, dtype, param,
                                                  compression)

    def _name(self, kind, i):
        return f"{self._prefix}{kind}_{i}"

    def _declare(self, name, shape, dtype, param, compression):
        existing = core.declaration(name)
        if existing is not None and shape is not None and existing.shape is not None and \
                (tuple(existing.shape) != shape or existing.dtype != dtype):
            raise ValueError(f"DistributedTrainer: {name!r} was declared before for a "
                             f"{existing.shape} {existing.dtype} tensor, but {param.name!r} is "
                             f"{shape} {dtype}; give a second trainer in this process its own "
                             "prefix=")
        return core.declare(name, shape=shape, dtype=dtype, **compression)

    def set_epoch(self, epoch):
        """The epoch the following steps belong to (the step context's ``epoch``: DGC's
        sparsity warm-up); call it at the start of every epoch, with the same value everywhere."""
        self._epoch = checked_epoch(epoch)

    def step(self, batch_size, ignore_stale_grad=False):
        # gradients are divided by batch_size * size() before the push: the optimizer's
        # rescale_grad (self._scale / batch_size) must be 1
        self._scale = batch_size
        super().step(batch_size, ignore_stale_grad)

    def _init_params(self):
        """Broadcast from root_rank: the others zero their copy, then a sum (push_pull)."""
        deferred, pending = [], []
        for param in self._params_to_init:
            if param._deferred_init:
                deferred.append(param)
                continue
            host = HostArray(param.list_data()[0], write=True)
            if core.rank() != self.root_rank:
                host.array[...] = 0
            i = self._param2idx[param.name]
            pending.append((host, core.push_pull(host.array, self._name("parameter", i),
                                                 average=False, priority=0)))
        for host, handle in pending:
            handle.wait()
            host.commit()
        self._params_to_init = deferred

    def _step_lr(self):
        """The learning rate this step's update will use (error feedback scales by it): with a
        scheduler, the optimizer asks it for ``num_update + 1`` only after this reduction."""
        opt = self._optimizer
        if opt.lr_scheduler is not None:
            return float(opt.lr_scheduler(opt.num_update + 1))
        return float(opt.lr)

    def _allreduce_grads(self):
        ctx = binding_context(self._step_lr(), self._optimizer.num_update, self._epoch,
                              self._bps_size if self._dgc else None)
        factor = 1.0 / (self._scale * self._bps_size)
        pending, entire = [], []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            host = HostArray(param.list_grad()[0], write=True)
            host.array *= host.array.dtype.type(factor)
            if i in self._in_entire:
                entire.append((i, param, host, None))
                continue
            handle = core.push_pull(host.array, self._name("gradient", i), average=False,
                                    priority=-i, ctx=ctx)
            pending.append((i, param, host, handle))
        if entire:
            self._reduce_entire_model([host for _, _, host, _ in entire], ctx)
        for i, param, host, handle in pending + entire:
            if handle is not None:
                handle.wait()
            adapter = self._adapter(i, host.array)
            if adapter is not None:
                weights = HostArray(param.list_data()[0], write=False)
                adapter(host.array, weights.array)
            host.commit()

    def _reduce_entire_model(self, hosts, ctx):
        self._make_entire_model([h.array for h in hosts])
        self._entire.reduce([h.array for h in hosts], ctx, average=False)

    def _make_entire_model(self, arrays):
        if self._entire is None:
            self._entire = EntireModel(self._name("gradient", "entiremodel"), [a.shape for a in arrays],
                                       one_dtype(a.dtype for a in arrays), self._entire_params,
                                       self._reducer)

    def save_states(self, fname):
        """gluon's optimizer states to ``fname`` and this rank's codec state beside it, both
        written atomically (mxnet/trainer_state.py); call it on every rank."""
        trainer_state.save(self, fname, super().save_states)

    def load_states(self, fname):
        """What ``save_states`` wrote; before the first step (mxnet/trainer_state.py)."""
        trainer_state.load(self, fname, super().load_states)

    def _adapter(self, i, grad):
        if i not in self._adapters:
            # compressed as the core decided (with one worker process and no
            # BYTEPS_FORCE_DISTRIBUTED nothing is: every tensor then gets the NAG here)
            if i in self._in_entire:
                compressed = self._entire.compressed
            else:
                compressed = core.declaration(self._name("gradient", i)).compressed  # placed by now
            self._adapters[i] = self._plan.adapter(grad.shape, grad.dtype, bool(compressed))
        return self._adapters[i]
