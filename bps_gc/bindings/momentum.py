"""Moving the optimizer's momentum (and, for onebit, weight decay) into the codec chain.

With ``compression_params={"momentum": "nesterov"}`` BytePS takes ``momentum`` (and for onebit
``wd``) out of the optimizer: compressed gradients get nesterov momentum inside the worker's
codec chain, before compression. What is left happens after the pull, per tensor:

* a tensor too small to be compressed gets NAG here instead: ``m = mu*(m + g); g = g + m``;
* onebit's weight decay: ``c = wd*x``; compressed tensors ``m = mu*(m + c); g += m + c``,
  small ones ``g += c``.
"""
import numpy as np

from ..compress import CompressionParams


class MomentumPlan:
    """The optimizer changes and per-tensor codec parameters for one training job."""

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
        # BytePS: only onebit takes weight decay into the adapter
        self.moves_weight_decay = self.moves_momentum and params.compressor == "onebit" and bool(weight_decay)
        self.wd = float(weight_decay or 0.0) if self.moves_weight_decay else 0.0

    def tensor_params(self):
        """compression_params as declared for a gradient (mu included when momentum moves)."""
        return self.params.to_dict()

    def adapter(self, shape, dtype, compressed):
        """The post-pull step of one tensor; ``compressed``: whether the worker core compresses
        it (not below BYTEPS_MIN_COMPRESS_BYTES, nor in a single undistributed process), i.e.
        whether the codec chain applied the momentum."""
        if not self.moves_momentum:
            return None
        return PostPull(shape, dtype, self.mu, self.wd, compressed, self.moves_weight_decay)


class PostPull:
    """Per-tensor state applied to the pulled gradient ``g`` (in place) given the weights ``x``."""

    def __init__(self, shape, dtype, mu, wd, compressed, weight_decay):
        self.mu, self.wd = np.dtype(dtype).type(mu), np.dtype(dtype).type(wd)
        self.compressed, self.weight_decay = compressed, weight_decay
        self.nag = None if compressed else np.zeros(shape, dtype)
        self.wd_mom = np.zeros(shape, dtype) if weight_decay and compressed else None
        self.cache = np.empty(shape, dtype) if weight_decay else None

    def __call__(self, g, x):
        if self.nag is not None:  # the codec chain did not see this tensor
            self.nag += g
            self.nag *= self.mu
            g += self.nag
        if self.weight_decay:
            np.multiply(x, self.wd, out=self.cache)
            if self.wd_mom is not None:
                self.wd_mom += self.cache
                self.wd_mom *= self.mu
                g += self.wd_mom
            g += self.cache
        return g
