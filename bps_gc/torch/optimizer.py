"""DistributedOptimizer: gradient hooks push_pull each gradient as soon as backward produced it
(communication overlaps the rest of the backward pass); ``step()`` waits for them, applies what
moved out of the optimizer (bps_gc.algorithms.momentum), then runs the wrapped optimizer.

With ``compression_params["granularity"] = "entiremodel"`` the gradients are reduced together in
``step()``, compressed as one vector (bps_gc.algorithms.entire_model). The step context every
codec sees is ``{"lr", "step", "epoch"}``: ``step`` counts ``step()`` calls, ``epoch`` is what
``set_epoch(e)`` set last (DGC's sparsity warm-up reads it; default 0).

With ``gradient_as_bucket_view=True`` the dense CPU gradients are views of flat buffers
(flat_grads.py), laid out in the order the hooks push them (first guessed as the reverse of the
parameters' order, as DDP does, then laid out again once after the first step in the order
seen): the collective transport all_reduces them where they lie, no copy in or out. The
gradients stay views: ``zero_grad()`` zeroes the buffers instead of setting them to None.

Each gradient goes through ``ops.push_pull_async``, so the codec chain that runs follows
BPS_GC_DEVICE_CODECS (docs/device_codecs.md): device chains for CUDA gradients by default.
What still runs on host copies of a device gradient: the entire-model vector
(``granularity="entiremodel"``) and the post-pull momentum/weight-decay step of
``compression_params["momentum"]`` (algorithms.momentum, numpy).
"""
import contextlib

import torch

import bps_gc.core as core

from ..algorithms.entire_model import EntireModel, is_entire_model, one_dtype
from ..algorithms.momentum import MomentumPlan, split_reducer, tensor_compression
from ..algorithms.step import binding_context, checked_epoch
from ..compress import CompressionParams
from . import ops
from .checkpoint import load_with_codec_state, register, with_codec_state
from .dtensors import refuse_dtensors
from .flat_grads import FlatGrads

ENTIRE_MODEL_NAME = "__entiremodel__"


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 compression_params, gradient_as_bucket_view=False):
        super(self.__class__, self).__init__(params)
        if not core.is_initialized():
            raise RuntimeError("DistributedOptimizer: call bps_gc.torch.init() first")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._compression = compression
        self._passes = backward_passes_per_step
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(kv, tuple) or len(kv) != 2 for kv in named):
                raise TypeError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
            names = {id(p): n for n, p in named}
            missing = [i for i, p in enumerate(all_params) if id(p) not in names]
            if missing:
                raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's parameters")
        else:
            names = {id(p): f"param.{i}" for i, p in enumerate(all_params)}
        refuse_dtensors("DistributedOptimizer", [(names[id(p)], p) for p in all_params],
                        "and step a plain torch optimizer")
        self._group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        compression_params, self._reducer = split_reducer(compression_params)
        self._plan = MomentumPlan.from_torch(self.param_groups, compression_params)
        # every worker declares the same names in the same (sorted) order
        self._params = sorted((p for p in all_params if p.requires_grad), key=lambda p: names[id(p)])
        self._names = {id(p): f"Gradient.{names[id(p)]}" for p in self._params}
        low = [names[id(p)] for p in self._params if p.dtype == torch.bfloat16]
        if low and (self._plan or is_entire_model(compression_params)):  # both run numpy on the values
            raise TypeError(f"DistributedOptimizer: {low[0]!r} is torch.bfloat16, which numpy (the momentum moved "
                            f"after the pull, the entire-model vector) cannot take; {ops.BFLOAT16_ELSEWHERE}")
        self._post_pull = {}
        fp16 = compression is not None and compression.__name__ == "FP16Compressor"
        self._entire, compressed = self._declare(compression_params, fp16)
        for p in self._params:
            if self._plan:
                self._post_pull[id(p)] = self._plan.adapter(tuple(p.shape), ops.SUPPORTED[p.dtype],
                                                            compressed[id(p)])
        self._handles = {}
        self._steps = 0  # the step context's step: synchronize() calls so far
        self._grad_factor = None  # set_gradient_factor: loss scaling's 1/scale
        self._epoch = 0
        self._dgc_workers = core.size() if compression_params.get("compressor") == "dgc" else None
        self._counts = {id(p): 0 for p in self._params}
        self._priority = {id(p): -i for i, p in enumerate(self._params)}
        # dense gradients as views of flat buffers, in the reverse of the parameters' order until
        # the first step shows the hooks' order (_started)
        dense = [p for p in reversed(all_params)
                 if id(p) in compressed and not compressed[id(p)] and id(p) not in self._in_entire]
        self._flat = FlatGrads(dense) if gradient_as_bucket_view else None
        self._started = [] if gradient_as_bucket_view else None  # the first step's push order
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._hook)
        register(self, "DistributedOptimizer")

    def _declare(self, compression_params, fp16):
        """Declares the gradients; returns (EntireModel or None, {id(p): compressed})."""
        entire = []
        if is_entire_model(compression_params):
            entire = [p for p in self._params
                      if tensor_compression(compression_params, p.dim()).get("compressor")]
            dtype = one_dtype(p.dtype for p in entire)
        self._in_entire = {id(p) for p in entire}
        base = self._plan.params.to_dict() if self._plan else dict(compression_params or {})
        if is_entire_model(base):
            CompressionParams.from_dict(base)  # e.g. entiremodel without a compressor: named
        if fp16:
            base["fp16"] = True
        compressed = {}
        for p in self._params:
            if id(p) not in self._in_entire:
                params = tensor_compression(base, p.dim())
                params.pop("granularity", None)
                reducer = self._reducer if params.get("compressor") else None
                declaration = ops.declare(self._names[id(p)], tuple(p.shape), p.dtype, reducer=reducer,
                                          **params)
                compressed[id(p)] = declaration.compressed
        if not entire:
            return None, compressed
        # named after its first gradient, so that a second optimizer in the process has its own
        model = EntireModel(f"{ENTIRE_MODEL_NAME}.{self._names[id(entire[0])]}",
                            [tuple(p.shape) for p in entire], ops.SUPPORTED[dtype], base,
                            self._reducer)
        compressed.update((id(p), model.compressed) for p in entire)
        return model, compressed

    def set_epoch(self, epoch):
        """The epoch the following steps belong to (the step context's ``epoch``: DGC's
        sparsity warm-up); call it at the start of every epoch, with the same value everywhere."""
        self._epoch = checked_epoch(epoch)

    def _context(self, lr):
        return binding_context(lr, self._steps, self._epoch, self._dgc_workers)

    def _hook(self, p):
        self._counts[id(p)] += 1
        if self._counts[id(p)] == self._passes and id(p) not in self._in_entire:
            self._start(p)

    def set_gradient_factor(self, factor):
        """Multiply each gradient by ``factor`` before it is pushed (None: as it is). A float16
        loss scaler sets 1/scale, so that the codecs (error feedback, DGC's momentum, thresholds)
        and the post-pull weight decay see true gradients, not scaled ones."""
        self._grad_factor = None if factor is None else float(factor)

    def _unscaled(self, p):
        if self._grad_factor is not None:
            with torch.no_grad():
                p.grad.mul_(self._grad_factor)

    def _start(self, p):
        if id(p) in self._handles:
            raise RuntimeError(f"{self._names[id(p)]}: gradient computed twice before step(); raise "
                               "backward_passes_per_step or call synchronize()")
        if self._flat is not None:
            self._flat.attach(p)  # a gradient that is not its view (set to None meanwhile): copied back
            if self._started is not None:
                self._started.append(p)
        self._unscaled(p)
        ctx = self._context(self._group_of[id(p)]["lr"])
        self._handles[id(p)] = ops.push_pull_async(p.grad, average=True, name=self._names[id(p)],
                                                   priority=self._priority[id(p)], ctx=ctx)

    def _reduce_entire_model(self):
        """The gradients of the entire-model vector, reduced as one (blocking)."""
        params = [p for p in self._params if id(p) in self._in_entire]
        views = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._unscaled(p)
            views.append(ops.host_view(p.grad))
        self._entire.reduce([array for array, _ in views], self._context(self.param_groups[0]["lr"]))
        with torch.no_grad():
            for p, (array, staged) in zip(params, views):
                if staged:
                    p.grad.copy_(torch.from_numpy(array))

    def synchronize(self):
        """Wait for every gradient's push_pull (starting those whose hook did not fire)."""
        for p in self._params:
            if id(p) not in self._handles and id(p) not in self._in_entire:
                if p.grad is None:  # unused this step: other workers still expect its push
                    p.grad = torch.zeros_like(p)
                self._start(p)
        if self._entire is not None:
            self._reduce_entire_model()
        for p in self._params:
            if id(p) in self._handles:
                ops.synchronize(self._handles.pop(id(p)))
            self._counts[id(p)] = 0
            adapter = self._post_pull.get(id(p))
            if adapter is not None:  # numpy (algorithms.momentum): off the CPU, on host copies
                g, staged = ops.host_view(p.grad)
                x, _ = ops.host_view(p.data)
                adapter(g, x)
                if staged:  # the adapter updated a copy: the gradient takes its values back
                    with torch.no_grad():
                        p.grad.copy_(torch.from_numpy(g))
        if self._started is not None:
            self._lay_out_as_pushed()
        self._steps += 1

    def _lay_out_as_pushed(self):
        """After the first step: the flat buffers laid out again in the order the gradients
        were pushed (once; the reduced values copied over), so each bucket's are back to back."""
        pushed = [p for p in self._started if id(p) in self._flat.views]
        ids = {id(p) for p in pushed}
        if [id(p) for p in pushed] != [id(p) for p in self._flat.params]:
            self._flat.lay_out(pushed + [p for p in self._flat.params if id(p) not in ids])
        self._started = None

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() without synchronize() (Horovod's): for a caller that synchronized itself, e.g.
        to unscale the reduced gradients of a float16 loss scaler before stepping."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None):
        if not getattr(self, "_skip_sync", False):
            self.synchronize()
        return super(self.__class__, self).step(closure)

    def state_dict(self):
        """The wrapped optimizer's state, and this rank's codec state under "bps_gc"
        (bps_gc.torch.state_dict(): every hook and optimizer of the process)."""
        return with_codec_state(super(self.__class__, self).state_dict())

    def load_state_dict(self, state_dict):
        return load_with_codec_state(state_dict, super(self.__class__, self).load_state_dict)

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise RuntimeError("zero_grad() while push_pulls are in flight; call step() or synchronize() first")
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)
        if self._flat is not None and set_to_none:  # views stay: the buffers zeroed at once instead
            self._flat.zero_()


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         compression_params=None, gradient_as_bucket_view=False):
    """Wrap ``optimizer`` so that ``step()`` uses gradients summed over all workers (averaged),
    compressed inter-node as ``compression_params`` says (see bps_gc.compress).
    ``gradient_as_bucket_view``: dense gradients as views of flat buffers (module docstring)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               compression_params, gradient_as_bucket_view)


__all__ = ["DistributedOptimizer"]
