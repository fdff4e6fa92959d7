"""Moving the optimizer's momentum (and, for onebit, weight decay) into the codec chain: the
one home of momentum handling for every binding. ``MomentumPlan.from_torch`` /
``MomentumPlan.from_mxnet`` take it out of the framework's optimizer, ``tensor_params`` puts
it into the declared codec chain (the ``nesterov`` decorator registered in compress/feedback.py
applies it before compression), and ``adapter`` does what is left after the pull.

With ``compression_params={"momentum": "nesterov"}`` (or ``"plain"``) BytePS takes ``momentum`` (and for onebit
``wd``) out of the optimizer: compressed gradients get nesterov momentum inside the worker's
codec chain, before compression. What is left happens after the pull, per tensor:

* a tensor too small to be compressed gets NAG here instead: ``m = mu*(m + g); g = g + m``
  (with ``"momentum": "plain"``: ``m = mu*m + g; g = m``);
* onebit's weight decay: ``c = wd*x``; compressed tensors ``m = mu*(m + c); g += m + c``
  (plain: ``m = mu*m + c; g += m``), small ones ``g += c``.
* DGC's weight decay (algorithms.md section 2.6: local, uncompressed, with its own momentum
  buffer): ``c = wd*x``; compressed tensors ``b = mu*b + c; g += b`` (the codec's momentum
  correction never sees it); dense ones (1-D, or too small) ``g += c`` before their NAG, i.e.
  the ordinary momentum SGD of the averaged gradient.

DGC sends 1-D tensors (biases, BatchNorm) dense: ``tensor_compression`` gives them no codec.
"""
import copy

import numpy as np

from ..compress import CompressionParams, choose_reducer
from ..compress.stateful import Stateful


class MomentumPlan(Stateful):
    """The optimizer changes and per-tensor codec parameters for one training job. It keeps no
    state between steps (its ``PostPull`` adapters do): its state dict is its identity, which
    a binding checks before it loads the adapters'."""

    def state_identity(self):
        return {"params": self.params.to_json().decode(), "mu": self.mu, "wd": self.wd}

    def __init__(self, compression_params, momentum, weight_decay):
        params = CompressionParams.from_dict(
            dict(compression_params or {}, **({"mu": momentum} if
                                              (compression_params or {}).get("momentum") else {})))
        if params.momentum and (momentum is None or momentum == 0):
            raise ValueError("compression_params['momentum'] needs momentum in the optimizer "
                             "(e.g. optimizer_params={'momentum': 0.9}); none was given")
        self.params = params
        self.mu = float(momentum or 0.0)
        self.moves_momentum = bool(params.momentum)
        self.nesterov = params.momentum != "plain"
        # BytePS: only onebit takes weight decay into the adapter; DGC keeps it local (its own rule)
        self.wd_rule = params.compressor if params.compressor in ("onebit", "dgc") else None
        self.moves_weight_decay = self.moves_momentum and bool(self.wd_rule) and bool(weight_decay)
        self.wd = float(weight_decay or 0.0) if self.moves_weight_decay else 0.0

    @classmethod
    def from_torch(cls, param_groups, compression_params):
        """The plan for a torch optimizer's ``param_groups`` (dicts); with
        compression_params['momentum'] their momentum (and onebit's weight decay) is zeroed.
        None when nothing moves."""
        if not (compression_params or {}).get("momentum"):
            return None
        moms = {g.get("momentum", 0) for g in param_groups}
        wds = {g.get("weight_decay", 0) for g in param_groups}
        if len(moms) > 1 or len(wds) > 1:
            raise ValueError("compression_params['momentum'] needs one momentum and weight_decay "
                             f"for all parameter groups, got {sorted(moms)} and {sorted(wds)}")
        plan = cls(compression_params, moms.pop(), wds.pop())
        for group in param_groups:
            group["momentum"] = 0
            if "nesterov" in group:
                group["nesterov"] = False
            if plan.moves_weight_decay:
                group["weight_decay"] = 0
        return plan

    @classmethod
    def from_mxnet(cls, optimizer, optimizer_params, compression_params):
        """(plan, optimizer, optimizer_params) for a gluon Trainer's optimizer, given as a name
        with ``optimizer_params`` or as an Optimizer object; what moves is taken out of a copy."""
        named = isinstance(optimizer, str)
        if named:
            momentum, wd = optimizer_params.get("momentum"), optimizer_params.get("wd")
        else:
            momentum, wd = getattr(optimizer, "momentum", None), optimizer.wd
        if compression_params.get("momentum") and not momentum:
            raise ValueError(
                f"compression_params['momentum']={compression_params['momentum']!r} moves the "
                "optimizer's momentum into the codec chain, but the optimizer has none: pass "
                "it in optimizer_params (e.g. {'momentum': 0.9}); got "
                f"momentum={momentum!r}")
        plan = cls(compression_params, momentum, wd)
        if plan.moves_momentum:
            if named:
                optimizer_params = dict(optimizer_params)
                optimizer_params.pop("momentum", None)
                if plan.moves_weight_decay:
                    optimizer_params.pop("wd", None)
            else:
                optimizer = copy.copy(optimizer)
                optimizer.momentum = 0.0
                if plan.moves_weight_decay:
                    optimizer.wd = 0.0
        return plan, optimizer, optimizer_params

    def tensor_params(self, ndim=2):
        """compression_params as declared for a gradient of ``ndim`` dimensions (mu included
        when momentum moves)."""
        return tensor_compression(self.params.to_dict(), ndim)

    def adapter(self, shape, dtype, compressed):
        """The post-pull step of one tensor; ``compressed``: whether the worker core compresses
        it (not below BYTEPS_MIN_COMPRESS_BYTES, nor in a single undistributed process), i.e.
        whether the codec chain applied the momentum."""
        if not self.moves_momentum:
            return None
        wd_rule = self.wd_rule if self.moves_weight_decay else None
        return PostPull(shape, dtype, self.mu, self.wd, compressed, wd_rule, self.nesterov)


def split_reducer(compression_params):
    """(compression_params without ``reducer``, the reducer name or None): the bindings take the
    servers' reducer (compress.reducers) as one more key and declare the compressed gradients
    with it. Checked here, so a bad name fails at the optimizer or trainer that was given it."""
    params = dict(compression_params or {})
    reducer = params.pop("reducer", None)
    if reducer is not None and params.get("compressor"):
        choose_reducer(CompressionParams.from_dict(params), reducer)
    elif reducer is not None:
        raise ValueError(f"compression parameter 'reducer' ({reducer!r}) needs a 'compressor'")
    return params, reducer


def tensor_compression(compression_params, ndim):
    """The compression a gradient of ``ndim`` dimensions is declared with: none for DGC's 1-D
    tensors (biases, BatchNorm: algorithms.md section 2), else ``compression_params``."""
    params = dict(compression_params or {})
    if params.get("compressor") == "dgc" and ndim <= 1:
        return {}
    return params


class PostPull(Stateful):
    """Per-tensor state applied to the pulled gradient ``g`` (in place) given the weights ``x``.
    ``wd_rule``: None, "onebit" or "dgc" (whose weight decay moved out of the optimizer)."""

    state_attrs = ("nag", "wd_mom")  # each None where this tensor keeps none

    def state_identity(self):
        holder = self.nag if self.nag is not None else self.wd_mom
        return {"mu": str(self.mu), "wd": str(self.wd), "wd_rule": self.wd_rule or "",
                "compressed": int(self.nag is None), "nesterov": int(self.nesterov),
                "shape": str(tuple(holder.shape)) if holder is not None else ""}

    def __init__(self, shape, dtype, mu, wd, compressed, wd_rule, nesterov=True):
        self.mu, self.wd = np.dtype(dtype).type(mu), np.dtype(dtype).type(wd)
        self.wd_rule, self.nesterov = wd_rule, nesterov
        self.nag = None if compressed else np.zeros(shape, dtype)
        self.wd_mom = np.zeros(shape, dtype) if wd_rule and compressed else None
        self.cache = np.empty(shape, dtype) if wd_rule else None

    def __call__(self, g, x):
        if self.wd_rule == "dgc":
            return self._dgc(g, x)
        if self.nag is not None:  # the codec chain did not see this tensor
            self._momentum(self.nag, g, g)
        if self.wd_rule:
            np.multiply(x, self.wd, out=self.cache)
            if self.wd_mom is None:
                g += self.cache
            elif self.nesterov:
                self._momentum(self.wd_mom, self.cache, g, add=True)
                g += self.cache
            else:
                self._momentum(self.wd_mom, self.cache, g, add=True)
        return g

    def _momentum(self, m, c, g, add=False):
        """Nesterov: m = mu*(m + c); g = c + m (or g += m). Plain: m = mu*m + c; g = m (or
        g += m). ``c`` may be ``g`` itself."""
        if self.nesterov:
            m += c
            m *= self.mu
        else:
            m *= self.mu
            m += c
        if add or self.nesterov:
            g += m
        else:
            np.copyto(g, m)

    def _dgc(self, g, x):
        np.multiply(x, self.wd, out=self.cache)
        if self.wd_mom is not None:  # b = mu*b + wd*x; g += b
            self.wd_mom *= self.mu
            self.wd_mom += self.cache
            g += self.wd_mom
            return g
        g += self.cache  # dense: ordinary momentum SGD of the averaged gradient
        self._momentum(self.nag, g, g)
        return g
