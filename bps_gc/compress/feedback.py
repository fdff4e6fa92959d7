"""Decorators around a codec: vanilla error feedback (workers and servers), nesterov momentum
(workers only). Order on a worker: momentum -> error feedback -> codec."""
import numpy as np

from .context import step_context
from .registry import register_error_feedback, register_momentum


class Decorator:
    """Forwards everything but compress to the wrapped codec."""

    def __init__(self, inner, params):
        self.inner, self.params = inner, params
        self.n, self.dtype = inner.n, inner.dtype

    def decompress(self, payload, out=None):
        return self.inner.decompress(payload, out)

    def decompress_add(self, payload, acc):
        self.inner.decompress_add(payload, acc)

    def residual(self, payload, x):
        self.inner.residual(payload, x)


@register_error_feedback("vanilla")
class VanillaErrorFeedback(Decorator):
    """g += (lr_prev / lr) * e; c = C(g); e = g - D(c). A zero lr gives ratio 1 (BytePS: NaN)."""

    def __init__(self, inner, params):
        super().__init__(inner, params)
        self.error = np.zeros(self.n, self.dtype)
        self.lr_prev = 0.0

    def compress(self, x, ctx=None):
        ctx = step_context(ctx)
        lr = ctx["lr"]
        e = self.error
        if lr and self.lr_prev and self.lr_prev != lr:
            # BytePS scales by a float32 ratio, then adds: two float32 roundings, as here
            np.multiply(e, np.float32(self.lr_prev / lr), out=e)
        np.add(e, np.asarray(x, self.dtype).reshape(-1), out=e)  # e now holds the corrected g
        payload = self.inner.compress(e, ctx)
        self.inner.residual(payload, e)
        self.lr_prev = lr
        return payload


@register_momentum("nesterov")
class NesterovMomentum(Decorator):
    """m = g + mu*m; g = g + mu*m; then the inner chain."""

    def __init__(self, inner, params):
        super().__init__(inner, params)
        self.mu = self.dtype.type(params.mu)
        self.momentum = np.zeros(self.n, self.dtype)
        self._grad = np.empty(self.n, self.dtype)

    def compress(self, x, ctx=None):
        x = np.asarray(x, self.dtype).reshape(-1)
        m = self.momentum
        m *= self.mu
        m += x
        np.multiply(m, self.mu, out=self._grad)
        self._grad += x
        return self.inner.compress(self._grad, ctx)
