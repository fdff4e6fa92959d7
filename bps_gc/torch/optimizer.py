"""DistributedOptimizer: gradient hooks push_pull each gradient as soon as backward produced it
(communication overlaps the rest of the backward pass); ``step()`` waits for them, applies what
moved out of the optimizer (bps_gc.bindings.momentum), then runs the wrapped optimizer."""
import torch

import bps_gc.core as core

from ..bindings.momentum import MomentumPlan
from . import ops


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 compression_params):
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
        self._group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        self._plan = MomentumPlan.from_torch(self.param_groups, compression_params)
        # every worker declares the same names in the same (sorted) order
        self._params = sorted((p for p in all_params if p.requires_grad), key=lambda p: names[id(p)])
        self._names = {id(p): f"Gradient.{names[id(p)]}" for p in self._params}
        self._post_pull = {}
        for p in self._params:
            params = self._plan.tensor_params() if self._plan else dict(compression_params or {})
            if compression is not None and compression.__name__ == "FP16Compressor":
                params["fp16"] = True
            declaration = ops.declare(self._names[id(p)], tuple(p.shape), p.dtype, **params)
            if self._plan:
                self._post_pull[id(p)] = self._plan.adapter(tuple(p.shape), ops.SUPPORTED[p.dtype],
                                                            declaration.compressed)
        self._handles = {}
        self._steps = 0  # the step context's step: synchronize() calls so far
        self._counts = {id(p): 0 for p in self._params}
        self._priority = {id(p): -i for i, p in enumerate(self._params)}
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        self._counts[id(p)] += 1
        if self._counts[id(p)] == self._passes:
            self._start(p)

    def _start(self, p):
        if id(p) in self._handles:
            raise RuntimeError(f"{self._names[id(p)]}: gradient computed twice before step(); raise "
                               "backward_passes_per_step or call synchronize()")
        ctx = {"lr": float(self._group_of[id(p)]["lr"]), "step": self._steps, "epoch": 0}
        self._handles[id(p)] = ops.push_pull_async(p.grad, average=True, name=self._names[id(p)],
                                                   priority=self._priority[id(p)], ctx=ctx)

    def synchronize(self):
        """Wait for every gradient's push_pull (starting those whose hook did not fire)."""
        for p in self._params:
            if id(p) not in self._handles:
                if p.grad is None:  # unused this step: other workers still expect its push
                    p.grad = torch.zeros_like(p)
                self._start(p)
        for p in self._params:
            ops.synchronize(self._handles.pop(id(p)))
            self._counts[id(p)] = 0
            adapter = self._post_pull.get(id(p))
            if adapter is not None:
                g, _ = ops.host_view(p.grad)
                x, _ = ops.host_view(p.data)
                adapter(g, x)
        self._steps += 1

    def step(self, closure=None):
        self.synchronize()
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise RuntimeError("zero_grad() while push_pulls are in flight; call step() or synchronize() first")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         compression_params=None):
    """Wrap ``optimizer`` so that ``step()`` uses gradients summed over all workers (averaged),
    compressed inter-node as ``compression_params`` says (see bps_gc.compress)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               compression_params)


__all__ = ["DistributedOptimizer"]
