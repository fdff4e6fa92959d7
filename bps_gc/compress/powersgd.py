"""PowerSGD (Vogels et al., 2019): rank-r power iteration with error feedback and warm start.

The partition is viewed as a rows x cols float32 matrix M (cols = ceil(sqrt(n)),
rows = ceil(n / cols), zero-padded), and one step takes two reduce phases through the runtime,
each a plain sum over the workers:

1. ``compress(x, ctx)``: M = x + error; payload P = M Q (rows x r float32, row-major);
2. ``compress_q(p_sum)``: P^ = orthogonalize(sum of P); payload Q = M^T P^ (cols x r);
3. ``finish(q_sum, out, workers)``: out = P^ (sum of Q)^T, the approximate sum; the error
   becomes M - out / workers (PyTorch's hook: the local input minus the approximate mean);
   the summed Q is the next step's start (warm start).

Q starts as the same seeded Gaussian matrix on every worker (the sums need one Q).
``decompress`` takes P^ followed by Q (the two payloads back to back) and returns P^ Q^T.
"""
import math

import numpy as np

from ._native import lib, ptr
from .base import Codec
from .params import CODEC_OPTIONS
from .registry import register_compressor


def matrix_shape(n):
    cols = math.isqrt(n - 1) + 1 if n > 1 else 1
    return -(-n // cols), cols


def orthogonalize(p):
    """Orthonormal columns spanning those of p (Householder QR, float32): stable at full rank,
    where Gram-Schmidt in float32 loses orthogonality."""
    q, r = np.linalg.qr(p.astype(np.float32))
    return np.ascontiguousarray(q, np.float32)


@register_compressor("powersgd", options=CODEC_OPTIONS["powersgd"])
class PowerSGD(Codec):
    phases = 2
    # two plain-sum reduce phases (P, then Q), which the runtime's own reducer drives; until it
    # exists, declaring a powersgd tensor fails naming this reducer
    reducers = ("powersgd",)

    def __init__(self, params, n, dtype, seed):
        super().__init__(params, n, dtype)
        if self.dtype not in (np.float32, np.float16):
            raise TypeError(f"powersgd: float32 or float16 partitions only, got {self.dtype}")
        self.rows, self.cols = matrix_shape(self.n)
        self.rank = min(int(dict(params.options).get("rank", 1)), self.rows, self.cols)
        self.q = np.random.default_rng(int(seed)).standard_normal(
            (self.cols, self.rank)).astype(np.float32)
        self.error = np.zeros(self.n, np.float32)
        self.m = np.zeros((self.rows, self.cols), np.float32)
        self.p_hat = None

    def _product(self, p, q, out):
        """The first n elements of P Q^T, written into ``out`` (float32), in one pass (numpy's
        matmul would fill the padded matrix, slowly for an inner size of 1, then copy)."""
        p, qt = np.ascontiguousarray(p, np.float32), np.ascontiguousarray(q.T, np.float32)
        lib.lowrank_product_f32(ptr(p), ptr(qt), self.rows, self.cols, self.rank, self.n, ptr(out))
        return out

    def _into(self, out, fill):
        """fill(float32 target) and return ``out`` (float16 outputs go through float32)."""
        out = self._output(out)
        if out.dtype == np.float32:
            return fill(out)
        with np.errstate(over="ignore"):
            out[:] = fill(np.empty(self.n, np.float32))
        return out

    def _matrix(self, payload, rows, what):
        buf = self._payload(payload, rows * self.rank * 4)
        return np.frombuffer(buf.tobytes(), np.float32).reshape(rows, self.rank), what

    def compress(self, x, ctx=None):
        x = self._input(x)
        x = x.astype(np.float32) if self.dtype == np.float16 else x
        p = np.empty((self.rows, self.rank), np.float32)
        qt = np.ascontiguousarray(self.q.T)
        lib.powersgd_p_f32(ptr(x), ptr(self.error), self.n, self.rows, self.cols, ptr(qt),
                           self.rank, ptr(self.m), ptr(p))
        return p.view(np.uint8).reshape(-1)

    def compress_q(self, p_sum):
        p, _ = self._matrix(p_sum, self.rows, "P")
        self.p_hat = orthogonalize(p)
        qt = np.empty((self.rank, self.cols), np.float32)
        lib.powersgd_q_f32(ptr(self.m), self.rows, self.cols, ptr(self.p_hat), self.rank, ptr(qt))
        return np.ascontiguousarray(qt.T).view(np.uint8).reshape(-1)

    def finish(self, q_sum, out=None, workers=1):
        if self.p_hat is None:
            raise ValueError("powersgd: finish() before compress_q()")
        q, _ = self._matrix(q_sum, self.cols, "Q")
        m = self.m.reshape(-1)

        def fill(approx):
            self._product(self.p_hat, q, approx)
            # error = M - approx / workers in one pass; a non-finite step shows in out, not later
            if not lib.scale_add_f32(ptr(approx), -1.0 / workers, ptr(m), self.n, ptr(self.error)):
                self.error[:] = 0
            return approx
        out = self._into(out, fill)
        self.q = q.copy()
        return out

    def decompress(self, payload, out=None):
        split = self.rows * self.rank * 4
        buf = self._payload(payload, split + self.cols * self.rank * 4)
        p, _ = self._matrix(buf[:split], self.rows, "P")
        q, _ = self._matrix(buf[split:], self.cols, "Q")
        with np.errstate(over="ignore", invalid="ignore"):  # any float32 bits are a valid payload
            return self._into(out, lambda target: self._product(p, q, target))
