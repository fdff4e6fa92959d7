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
        self._plan = self._move_momentum(compression_params or {})
        # every worker declares the same names in the same (sorted) order
        self._params = sorted((p for p in all_params if p.requires_grad), key=lambda p: names[id(p)])
        self._names = {id(p): f"Gradient.{names[id(p)]}" for p in self._params}
        self._post_pull = {}
        for p in self._params:
            params = self._plan.tensor_params() if self._plan else dict(compression_params or {})
            if compression is not None and compression.__name__ == "FP16Compressor":
                params["fp16"] = True
            ops.declare(self._names[id(p)], tuple(p.shape), p.dtype, **params)
            if self._plan:
                compressed = core.worker().tensors[self._names[id(p)]].compressed
                self._post_pull[id(p)] = self._plan.adapter(tuple(p.shape), ops.SUPPORTED[p.dtype], compressed)
        self._handles = {}
        self._counts = {id(p): 0 for p in self._params}
        self._priority = {id(p): -i for i, p in enumerate(self._params)}
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _move_momentum(self, compression_params):
        """With compression_params['momentum'], the optimizer's momentum (and onebit's weight
        decay) move into the codec chain and the post-pull adapters."""
        if not compression_params.get("momentum"):
            return None
        moms = {g.get("momentum", 0) for g in self.param_groups}
        wds = {g.get("weight_decay", 0) for g in self.param_groups}
        if len(moms) > 1 or len(wds) > 1:
            raise ValueError("compression_params['momentum'] needs one momentum and weight_decay "
                             f"for all parameter groups, got {sorted(moms)} and {sorted(wds)}")
        plan = MomentumPlan(compression_params, moms.pop(), wds.pop())
        for group in self.param_groups:
            group["momentum"] = 0
            if "nesterov" in group:
                group["nesterov"] = False
            if plan.moves_weight_decay:
                group["weight_decay"] = 0
        return plan

    def _hook(self, p):
        self._counts[id(p)] += 1
        if self._counts[id(p)] == self._passes:
            self._start(p)

    def _start(self, p):
        if id(p) in self._handles:
            raise RuntimeError(f"{self._names[id(p)]}: gradient computed twice before step(); raise "
                               "backward_passes_per_step or call synchronize()")
        lr = float(self._group_of[id(p)]["lr"])
        self._handles[id(p)] = ops.push_pull_async(p.grad, average=True, name=self._names[id(p)],
                                                   priority=self._priority[id(p)], lr=lr)

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
