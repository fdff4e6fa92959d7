"""Error feedback (vanilla) and momentum (nesterov, plain) around any device codec (HostBridge too),
with the numpy decorators' arithmetic (compress/feedback.py): ``out = a * s + x`` in two
roundings of the partition's dtype, state kept only when every result is finite."""
import math

import numpy as np
import torch

from ..context import step_context
from ..scratch import lends_g
from .base import DeviceCodec, shared_tensor
from .registry import register_device_error_feedback, register_device_momentum


def scale_add(a, s, x, out):
    """out = a * s + x, rounded after the product and after the sum like numpy's multiply then
    add (two kernels: nothing fuses them into one multiply-add). ``s`` must already be a value
    of the dtype (for float16 the product of two float16 values is exact in float32, which is
    where both numpy and torch compute it)."""
    torch.mul(a, s, out=out)
    out.add_(x)


def all_finite(*tensors):
    """One device-to-host sync for whether every element of the tensors is finite."""
    ok = torch.isfinite(tensors[0]).all()
    for t in tensors[1:]:
        ok = ok & torch.isfinite(t).all()
    return bool(ok)


class DeviceDecorator(DeviceCodec):
    """Forwards everything but compress to the wrapped device codec; state keys and identity
    as the numpy decorators' (compress/feedback.py)."""

    state_name = None

    def state_identity(self):
        return {"name": self.state_name}

    def state_children(self):
        return (("", self.inner),)

    def __init__(self, inner, params):
        self.inner, self.params = inner, params
        self.n, self.dtype, self.seed = inner.n, inner.dtype, inner.seed
        self.device, self.torch_dtype = inner.device, inner.torch_dtype
        self.reducers = inner.reducers
        self._scratch = None
        self.scratch = None  # or a compress.Scratch shared with other partitions' codecs

    def _state(self):
        return torch.zeros(self.n, dtype=self.torch_dtype, device=self.device)

    def decompress(self, payload, out=None):
        return self.inner.decompress(payload, out)

    def decompress_add(self, payload, acc):
        self.inner.decompress_add(payload, acc)

    def residual(self, payload, x):
        self.inner.residual(payload, x)


@register_device_error_feedback("vanilla")
class DeviceVanillaErrorFeedback(DeviceDecorator):
    """g = x + (lr_prev / lr) * e; c = C(g); e = g - D(c), as compress/feedback.py (a non-finite
    g is sent as all NaN and leaves e and lr_prev as they were)."""

    state_label, state_name, state_attrs = "ef.", "vanilla", ("error", "lr_prev")

    def __init__(self, inner, params):
        super().__init__(inner, params)
        self.error = self._state()
        self._spare = None  # made at the first step, unless a shared scratch freed after each call holds g
        self.lr_prev = 0.0

    def compress(self, x, ctx=None):
        x = self._input(x)
        lr = step_context(ctx)["lr"]
        ratio = np.float32(self.lr_prev / lr) if lr and self.lr_prev and self.lr_prev != lr else 1
        shared = lends_g(self.scratch)
        if shared:
            g = shared_tensor(self.scratch, "ef", self.n, self.torch_dtype, self.device)
        else:
            if self._spare is None:
                self._spare = self._state()
            g = self._spare
        scale_add(self.error, float(self.dtype.type(ratio)), x, g)
        if not all_finite(g):
            g.fill_(math.nan)
            return self.inner.compress(g, ctx)
        payload = self.inner.compress(g, ctx)
        self.inner.residual(payload, g)
        if shared:
            self.error.copy_(g)
        else:
            self.error, self._spare = g, self.error
        self.lr_prev = lr
        return payload


@register_device_momentum("nesterov")
class DeviceNesterovMomentum(DeviceDecorator):
    """m = g + mu*m; g = g + mu*m; then the inner chain (a non-finite step leaves m as it was and
    goes down the chain as all NaN), as compress/feedback.py."""

    state_label, state_name, state_attrs = "momentum.", "nesterov", ("momentum",)

    def __init__(self, inner, params):
        super().__init__(inner, params)
        self.mu = float(self.dtype.type(params.mu))
        self.momentum = self._state()
        self._spare = self._state()
        self._grad = self._state()

    def compress(self, x, ctx=None):
        x = self._input(x)
        m = self._spare
        scale_add(self.momentum, self.mu, x, m)
        scale_add(m, self.mu, x, self._grad)
        if all_finite(m, self._grad):
            self.momentum, self._spare = m, self.momentum
        else:
            self._grad.fill_(math.nan)
        return self.inner.compress(self._grad, ctx)


@register_device_momentum("plain")
class DevicePlainMomentum(DeviceNesterovMomentum):
    """m = g + mu*m; g = m; then the inner chain, as compress/feedback.py's PlainMomentum."""

    state_name = "plain"

    def compress(self, x, ctx=None):
        m = self._spare
        scale_add(self.momentum, self.mu, self._input(x), m)
        if all_finite(m):
            self.momentum, self._spare = m, self.momentum
            self._grad.copy_(m)
        else:
            self._grad.fill_(math.nan)
        return self.inner.compress(self._grad, ctx)
