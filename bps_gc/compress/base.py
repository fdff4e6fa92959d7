"""The interface every codec implements: one stateful object per tensor partition."""
import numpy as np

from .stateful import Stateful, codec_identity

DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))


class Codec(Stateful):
    """Compresses one partition of ``n`` elements of ``dtype``.

    ``compress(x, ctx)`` returns the payload as a fresh uint8 array; ``ctx`` is the step
    context (``context.step_context``: lr, step, epoch and per-step codec keys; a bare float is
    taken as the learning rate). ``decompress(payload, out)`` writes the dense
    decoded partition into ``out`` (allocated if None) and returns it; any codec object with the
    same parameters decodes any other's payload. Decorators (error feedback, momentum) wrap a
    codec and forward ``decompress``.
    """

    # server reducers this codec works with (``compress.reducers``); the first is the default
    reducers = ("recompress", "lossless")
    state_label = "codec."  # compressors name their state attributes in ``state_attrs``
    # a tensor under BYTEPS_MIN_COMPRESS_BYTES is sent raw (comm/placement.py), unless its codec
    # saves no bytes anyway and is chosen for its reducer (identity.py)
    raw_when_small = True

    def __init__(self, params, n, dtype):
        dtype = np.dtype(dtype)
        if dtype not in DTYPES:
            raise TypeError(f"{type(self).__name__}: unsupported dtype {dtype}; "
                            f"supported: {', '.join(str(d) for d in DTYPES)}")
        if int(n) < 1:
            raise ValueError(f"{type(self).__name__}: partition must have >= 1 element, got {n}")
        self.params, self.n, self.dtype = params, int(n), dtype
        self._scratch = None  # the decoded payload of decompress_add and residual, kept
        self.scratch = None  # or a scratch.Scratch shared with other partitions' codecs

    def state_identity(self):
        return codec_identity(self)

    def compress(self, x, ctx=None):
        raise NotImplementedError

    def decompress(self, payload, out=None):
        raise NotImplementedError

    def decompress_add(self, payload, acc):
        """acc += decompress(payload), in place (a server summing pushes)."""
        acc += self.decompress(payload, self._decoded())

    def residual(self, payload, x):
        """x -= decompress(payload), in place (error feedback's ``e = g - D(c)``)."""
        x -= self.decompress(payload, self._decoded())

    def _decoded(self):
        """Where decompress_add and residual decode a payload."""
        if self.scratch is not None:
            return self.scratch.take("decoded", self.n, self.dtype)
        if self._scratch is None:
            self._scratch = np.empty(self.n, self.dtype)
        return self._scratch

    # helpers for subclasses --------------------------------------------------------------

    def _input(self, x):
        x = np.asarray(x)
        if x.dtype != self.dtype or x.size != self.n:
            raise ValueError(f"{type(self).__name__}: expected {self.n} elements of {self.dtype}, "
                             f"got {x.size} of {x.dtype}")
        return np.ascontiguousarray(x).reshape(-1)

    def _output(self, out):
        if out is None:
            return np.empty(self.n, self.dtype)
        if out.dtype != self.dtype or out.size != self.n or not out.flags.c_contiguous:
            raise ValueError(f"{type(self).__name__}: out must be a contiguous array of {self.n} "
                             f"{self.dtype}, got {out.size} of {out.dtype}")
        return out.reshape(-1)

    def _payload(self, payload, size=None):
        buf = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) \
            else payload.reshape(-1).view(np.uint8)
        if size is not None and buf.size != size:
            raise ValueError(f"{type(self).__name__}: payload of {buf.size} bytes, expected {size} "
                             f"for {self.n} elements")
        return buf
