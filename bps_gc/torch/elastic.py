"""BPS_GC_ELASTIC for torch scripts: a host joining the running job copies a live worker's model
and optimizer state (docs/elastic.md; the core's side: ps/worker/joining.py).

    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    start = bps.elastic_start(model, optimizer)   # 0 on a member; a joiner's first step
    for step in range(start, steps): ...

What is copied: the model's floating state_dict entries ("model.<name>": parameters and buffers)
and every tensor of the optimizer's per-parameter state ("optim.<parameter>.<key>", e.g. SGD's
momentum buffers). torch creates that state at the first step, so the donor names what it holds
when the join happens and the joiner makes the same entries (zeros, then filled). The codec state
(error feedback) starts at zero on the joiner, as in the numpy API. Every step must be one round
group: no other push_pull (a broadcast) between elastic_start and the steps, or the first step
returned is not a step number.
"""
import torch

import bps_gc.core as core

from .ops import host_view


class _ElasticState:
    """The arrays a joiner copies, as a function (joining.py calls it when the join happens)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.staged = []  # (tensor, host copy): device tensors, copied back on the joiner

    def tensors(self):
        """name -> tensor, in a fixed order: the model's, then the optimizer's state."""
        out = {f"model.{n}": t for n, t in self.model.state_dict().items() if t.dtype.is_floating_point}
        by_param = {id(p): p for group in self.optimizer.param_groups for p in group["params"]}
        for pid, p in sorted(by_param.items(), key=lambda kv: self.param_names.get(kv[0], "")):
            name = self.param_names.get(pid)
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if name is None:
                    raise ValueError("elastic_start: the optimizer steps a parameter the model does not name")
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"elastic_start: optimizer state {name}.{key} is a {type(value).__name__}, "
                                    "not a tensor: a joining host cannot copy it")
                out[f"optim.{name}.{key}"] = value
        return out

    def arrays(self, tensors):
        out = {}
        for name, t in tensors.items():
            array, staged = host_view(t)
            if staged:
                self.staged.append((t, array))
            out[name] = array
        return out

    def __call__(self, wanted=None):
        if wanted is None:  # the donor, at the join: its state as it is now
            self.staged = []
            return self.arrays(self.tensors())
        params = {id(p): p for n, p in self.model.named_parameters()}
        names = {n: pid for pid, n in self.param_names.items()}
        for name, dtype, shape in wanted:  # the joiner: make the lazily created state it lacks
            if name.startswith("optim."):
                pname, key = name[len("optim."):].rsplit(".", 1)
                p = params.get(names.get(pname))
                if p is not None and key not in self.optimizer.state[p]:
                    self.optimizer.state[p][key] = torch.zeros(shape, dtype=getattr(torch, dtype), device=p.device)
        mine = self.tensors()
        ordered = {name: mine[name] for name, _, _ in wanted if name in mine}
        ordered.update((n, t) for n, t in mine.items() if n not in ordered)  # extra ones: named as refused
        self.staged = []
        return self.arrays(ordered)


def elastic_start(model, optimizer):
    """BPS_GC_ELASTIC: call once after wrapping ``optimizer`` in DistributedOptimizer, before the
    first step. On a member returns 0; on a host joining the running job waits to be admitted,
    fills ``model``'s and ``optimizer``'s state from a live worker and returns its first step.
    Without BPS_GC_ELASTIC it returns 0 and does nothing."""
    state = _ElasticState(model, optimizer)
    start = core.elastic_start(state)
    with torch.no_grad():
        for tensor, array in state.staged if start else ():
            tensor.copy_(torch.from_numpy(array))
    if start and hasattr(optimizer, "_steps"):  # the step context (codecs' draws) counts on
        optimizer._steps = start
    return start


def membership():
    """The members' ranks of the last step, in order (every rank without BPS_GC_ELASTIC)."""
    return core.membership()


def membership_epoch():
    """The membership epoch of the last step: a sampler re-shards when it changes."""
    return core.membership_epoch()


__all__ = ["elastic_start", "membership", "membership_epoch"]
