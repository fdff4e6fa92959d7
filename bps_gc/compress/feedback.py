"""Decorators around a codec: vanilla error feedback (workers and servers), nesterov or plain
momentum (workers only). Order on a worker: momentum -> error feedback -> codec."""
import numpy as np

from ._native import lib, ptr
from .context import step_context
from .registry import register_error_feedback, register_momentum
from .scratch import lends_g
from .stateful import Stateful


class Forwarding:
    """Decoding by ``self.inner``, the codec that made the payload."""

    def decompress(self, payload, out=None):
        return self.inner.decompress(payload, out)

    def decompress_add(self, payload, acc):
        self.inner.decompress_add(payload, acc)

    def residual(self, payload, x):
        self.inner.residual(payload, x)


class Decorator(Forwarding, Stateful):
    """Forwards everything but compress to the wrapped codec; its state is saved before the
    wrapped codec's (``state_label`` and ``state_name``, the registered name, per subclass)."""

    state_name = None

    def state_identity(self):
        return {"name": self.state_name}

    def state_children(self):
        return (("", self.inner),)

    def __init__(self, inner, params):
        self.inner, self.params = inner, params
        self.n, self.dtype = inner.n, inner.dtype
        self.scratch = None  # or a scratch.Scratch shared with other partitions' codecs


def _scale_add(a, s, x, out):
    """out = a * s + x (numpy's two roundings); True when every result is finite."""
    if out.dtype == np.float32:
        return bool(lib.scale_add_f32(ptr(a), float(s), ptr(x), out.size, ptr(out)))
    if out.dtype == np.float64:
        return bool(lib.scale_add_f64(ptr(a), float(s), ptr(x), out.size, ptr(out)))
    with np.errstate(over="ignore", invalid="ignore"):  # reported by the return value
        np.multiply(a, s, out=out)
        np.add(out, x, out=out)
    return bool(lib.all_finite_u16(ptr(out), out.size))


def _flat(x, dtype):
    return np.ascontiguousarray(np.asarray(x, dtype)).reshape(-1)


@register_error_feedback("vanilla")
class VanillaErrorFeedback(Decorator):
    """g = x + (lr_prev / lr) * e; c = C(g); e = g - D(c). A zero lr gives ratio 1 (BytePS: NaN).

    A non-finite g (inf or NaN in the gradient, or an overflow) is sent as all NaN, so the
    round's result shows it whatever the codec keeps, and e and lr_prev stay as they were: later
    rounds are finite again (AMP's loss scaler skips that step). g is built in a second buffer
    (e is kept until g is known to be finite): its own, swapped with e so that keeping e costs
    no copy, or a shared scratch's (``scratch``, unless its buffers are kept between calls
    anyway), copied into e, so that only e is held between steps.
    """

    state_label, state_name, state_attrs = "ef.", "vanilla", ("error", "lr_prev")

    def __init__(self, inner, params):
        super().__init__(inner, params)
        self.error = np.zeros(self.n, self.dtype)
        self._spare = None  # made at the first step without a shared scratch
        self.lr_prev = 0.0

    def compress(self, x, ctx=None):
        lr = step_context(ctx)["lr"]
        # BytePS scales by a float32 ratio, then adds: two float32 roundings, as here
        ratio = np.float32(self.lr_prev / lr) if lr and self.lr_prev and self.lr_prev != lr else 1
        shared = lends_g(self.scratch)
        if shared:
            g = self.scratch.take("ef", self.n, self.dtype)
        else:
            if self._spare is None:
                self._spare = np.empty(self.n, self.dtype)
            g = self._spare
        if not _scale_add(self.error, self.dtype.type(ratio), _flat(x, self.dtype), g):
            g.fill(np.nan)
            return _owned(self.inner.compress(g, ctx), g)
        payload = _owned(self.inner.compress(g, ctx), g)
        self.inner.residual(payload, g)
        if shared:
            np.copyto(self.error, g)
        else:
            self.error, self._spare = g, self.error
        self.lr_prev = lr
        return payload


def _owned(payload, g):
    """``payload`` as an array of its own: g may be a shared scratch that the next partition
    overwrites before the payload is sent (codecs return fresh payloads; this keeps it so)."""
    return payload.copy() if np.may_share_memory(payload, g) else payload


@register_momentum("nesterov")
class NesterovMomentum(Decorator):
    """m = g + mu*m; g = g + mu*m; then the inner chain. A non-finite step leaves m as it was
    and goes down the chain as all NaN (as in error feedback)."""

    state_label, state_name, state_attrs = "momentum.", "nesterov", ("momentum",)

    def __init__(self, inner, params):
        super().__init__(inner, params)
        self.mu = self.dtype.type(params.mu)
        self.momentum = np.zeros(self.n, self.dtype)
        self._spare = np.empty(self.n, self.dtype)
        self._grad = np.empty(self.n, self.dtype)

    def compress(self, x, ctx=None):
        x = _flat(x, self.dtype)
        m = self._spare
        if _scale_add(self.momentum, self.mu, x, m) and _scale_add(m, self.mu, x, self._grad):
            self.momentum, self._spare = m, self.momentum
        else:
            self._grad.fill(np.nan)
        return self.inner.compress(self._grad, ctx)


@register_momentum("plain")
class PlainMomentum(NesterovMomentum):
    """Heavy-ball momentum: m = g + mu*m; g = m; then the inner chain (the plain form of DGC's
    momentum correction, and of SGD's momentum moved into the chain). Non-finite: as nesterov."""

    state_name = "plain"  # its state is not a nesterov chain's: loading one into the other is refused

    def compress(self, x, ctx=None):
        m = self._spare
        if _scale_add(self.momentum, self.mu, _flat(x, self.dtype), m):
            self.momentum, self._spare = m, self.momentum
            np.copyto(self._grad, m)
        else:
            self._grad.fill(np.nan)
        return self.inner.compress(self._grad, ctx)
