"""(Post-)local SGD in PyTorch (spec §4): local momentum steps, models averaged every H steps.

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    opt = bps.LocalSGD(opt, model.named_parameters(), local_steps=16, local_from_epoch=150)
    for epoch in ...:
        opt.set_epoch(epoch)
        ... loss.backward(); opt.step(); opt.zero_grad()

Every ``step()`` runs the wrapped optimizer on this worker's own gradients (its momentum buffers
are never averaged). The step synchronises when ``epoch < local_from_epoch`` (post-local SGD:
synchronous before the switch) or when ``step % local_steps == 0`` (the first step always does):
``delta = x_sync - x`` is averaged over the workers through the communicator's reduce
(bps_gc.core.push_pull, average=True), then ``x_sync -= mean(delta)`` and ``x = x_sync``. Only
parameters are averaged; buffers (BatchNorm running statistics) stay local. Call it after
``broadcast_parameters`` so that every worker starts from the same model.

``compression_params`` compress the averaged difference with any bps_gc codec, error feedback
included (``{"compressor": "signnorm", "ef": "vanilla"}``: ``p = delta + e``, ``C(p) =
(||p||_1/n) sign(p)``, ``e = p - C(p)``); where the runtime has reducers the mean is taken of the
decoded pushes (``lossless``) unless ``reducer`` says otherwise. ``{"compressor": "sign"}`` is
spec §4's scaled sign: per tensor the signs (1 bit each) and the scale ``||delta||_1/n`` are
averaged separately and ``x_sync -= mean(sign) * mean(scale)``.

``x_sync`` and the differences live where the parameters do, and go through
``bps_gc.torch.push_pull``: with device codec chains (BPS_GC_DEVICE_CODECS,
docs/device_codecs.md) a compressed difference leaves the device only as its payload.
"""
import inspect

import torch

import bps_gc.core as core

from . import ops
from .ops import SUPPORTED
from .checkpoint import register
from .wrapper import WrappingOptimizer

SIGN_PARAMS = {"compressor": "onebit", "scaling": False}  # 1 bit per element, decoded to +-1


def _reducers_supported():
    return "reducer" in inspect.signature(core.declare).parameters


def _step_context_supported():
    return "ctx" in inspect.signature(core.push_pull).parameters


class LocalSGD(WrappingOptimizer):
    """Wraps a local optimizer; its ``param_groups`` and ``state`` are shared (schedulers and
    checkpoints see the wrapped one)."""

    def __init__(self, optimizer, named_parameters, local_steps=1, local_from_epoch=0,
                 compression_params=None, reducer=None, prefix="LocalSGD"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LocalSGD wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not core.is_initialized():
            raise RuntimeError("LocalSGD: call bps_gc.torch.init() first")
        if int(local_steps) < 1:
            raise ValueError(f"LocalSGD: local_steps must be >= 1, got {local_steps}")
        self._wrap(optimizer)
        self.local_steps, self.local_from_epoch = int(local_steps), local_from_epoch
        self.steps, self.epoch, self.synchronizations = 0, 0, 0
        self.params = sorted(((n, p) for n, p in named_parameters if p.requires_grad), key=lambda kv: kv[0])
        for name, p in self.params:
            if p.dtype not in SUPPORTED:
                raise TypeError(f"LocalSGD: {name!r} has dtype {p.dtype}; float16/32/64 only")
        params = dict(compression_params or {})
        self.sign = params.get("compressor") == "sign"
        if self.sign and not _reducers_supported():
            raise RuntimeError("LocalSGD with compressor 'sign' averages the signs exactly, which needs a "
                               "runtime with reducers ('lossless'); this bps_gc has none")
        if reducer is None and params.get("compressor") and _reducers_supported():
            reducer = "lossless"  # the mean of what the workers sent, as spec §4 averages it
        extra = {"reducer": reducer} if reducer is not None else {}
        self.x_sync = {n: p.detach().clone(memory_format=torch.contiguous_format) for n, p in self.params}
        self.delta = {n: torch.empty_like(x) for n, x in self.x_sync.items()}
        self.keys = {n: f"{prefix}.{n}" for n, _ in self.params}
        for n, x in self.x_sync.items():
            ops.declare(self.keys[n], shape=tuple(x.shape), dtype=x.dtype,
                        **(dict(SIGN_PARAMS, **extra) if self.sign else dict(params, **extra)))
        if self.sign:
            self.scales_key = f"{prefix}.sign_scales"
            self.scales = torch.zeros(len(self.params), dtype=torch.float32)
            ops.declare(self.scales_key, shape=tuple(self.scales.shape), dtype=torch.float32)
        register(self, "LocalSGD")

    def set_epoch(self, epoch):
        """The training loop's epoch (post-local SGD switches at ``local_from_epoch``)."""
        self.epoch = epoch

    def synchronizes(self):
        """Whether the coming ``step()`` averages the models."""
        return self.epoch < self.local_from_epoch or self.steps % self.local_steps == 0

    def step(self, closure=None):
        with torch.no_grad():
            loss = self.optimizer.step(closure)
            if self.synchronizes():
                self._average()
        self.steps += 1
        return loss

    def _average(self):
        # the differences already hold the learning rate: error feedback sees a constant 1
        context = {"lr": 1.0, "step": self.steps, "epoch": self.epoch}
        ctx = {"ctx": context} if _step_context_supported() else {"lr": 1.0}
        handles = []
        for k, (name, p) in enumerate(self.params):
            delta = self.delta[name]
            torch.sub(self.x_sync[name], p, out=delta)
            if self.sign:
                self.scales[k] = float(delta.abs().sum(dtype=torch.float64)) / max(delta.numel(), 1)
                torch.sign(delta, out=delta)
            handles.append(ops.push_pull_async(delta, average=True, name=self.keys[name], **ctx))
        if self.sign:
            handles.append(ops.push_pull_async(self.scales, average=True, name=self.scales_key, **ctx))
        for h in handles:
            ops.synchronize(h)
        for k, (name, p) in enumerate(self.params):
            delta = self.delta[name]
            if self.sign:
                delta *= float(self.scales[k])
            self.x_sync[name] -= delta
            p.copy_(self.x_sync[name])
        self.synchronizations += 1


__all__ = ["LocalSGD"]
