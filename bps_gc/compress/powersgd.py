"""PowerSGD (Vogels et al., 2019): rank-r power iteration with error feedback and warm start.

The partition is viewed as a rows x cols float32 matrix M: the tensor's first dimension by the
rest when the partition holds whole rows of a tensor of two or more dimensions, else near-square
(cols = ceil(sqrt(n)), rows = ceil(n / cols), zero-padded). One step takes two reduce phases,
each a plain sum over the workers, which the communicator drives (bps_gc/comm/phased.py):

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
from .reducers import PhasedSums, register_reducer
from .registry import register_compressor


def matrix_shape(n, shape=None):
    """rows x cols of the matrix view of an n-element partition: the tensor's own (its first
    dimension by the rest, as PyTorch's PowerSGD hook) when ``shape``, the whole tensor's, has
    two or more dimensions and the partition holds whole rows of it; else near-square."""
    if shape is not None and len(shape) >= 2:
        cols = math.prod(int(s) for s in shape[1:])
        if cols and n % cols == 0:
            return n // cols, cols
    cols = math.isqrt(n - 1) + 1 if n > 1 else 1
    return -(-n // cols), cols


def matrix_identity(codec, base):
    """A PowerSGD codec's state identity (numpy and device): ``base`` and its matrix view."""
    return {**base, "matrix": f"{codec.rows}x{codec.cols}", "rank": codec.rank}


def orthogonalize(p):
    """Orthonormal columns spanning those of p (Householder QR, float32): stable at full rank,
    where Gram-Schmidt in float32 loses orthogonality."""
    q, r = np.linalg.qr(p.astype(np.float32))
    return np.ascontiguousarray(q, np.float32)


@register_compressor("powersgd", options=CODEC_OPTIONS["powersgd"])
class PowerSGD(Codec):
    # two plain-sum reduce phases (P, then Q) that the communicator drives (reducer below)
    reducers = ("powersgd",)

    takes_shape = True  # build_chain passes the tensor's shape (the matrix view)
    # M and P^ are rebuilt each step; Q (the warm start) and the error carry over
    state_attrs = ("q", "error")

    def state_identity(self):
        return matrix_identity(self, super().state_identity())

    def __init__(self, params, n, dtype, seed, shape=None):
        super().__init__(params, n, dtype)
        if self.dtype not in (np.float32, np.float16):
            raise TypeError(f"powersgd: float32 or float16 partitions only, got {self.dtype}")
        self.rows, self.cols = matrix_shape(self.n, shape)
        self.rank = min(int(dict(params.options).get("rank", 1)), self.rows, self.cols)
        self.q = np.random.default_rng(int(seed)).standard_normal(
            (self.cols, self.rank)).astype(np.float32)
        self.error = np.zeros(self.n, np.float32)
        self.m = None  # M = x + error (its padding zero), from compress to finish: _matrix_m
        self.p_hat = None

    @property
    def phase_sizes(self):
        """float32 elements of each phase's payload: P, then Q."""
        return self.rows * self.rank, self.cols * self.rank

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
        self.m = self._matrix_m()
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
        if np.isfinite(q).all():  # a non-finite step's Q would make every later warm start NaN
            self.q = q.copy()
        if self.scratch is not None:  # the shared scratch's M is freed after the call: not held
            self.m = None
        return out

    def _matrix_m(self):
        """The rows x cols float32 matrix M is built in: its own, kept for the next step, or
        (a shared scratch) one of the call's, which the exchange frees once it is done."""
        if self.scratch is None:
            if self.m is None:
                self.m = np.zeros((self.rows, self.cols), np.float32)
            return self.m
        m = self.scratch.take(("powersgd.m", id(self)), self.rows * self.cols, np.float32)
        m[self.n:] = 0  # the kernel leaves the padding as it finds it
        return m.reshape(self.rows, self.cols)

    def decompress(self, payload, out=None):
        split = self.rows * self.rank * 4
        buf = self._payload(payload, split + self.cols * self.rank * 4)
        p, _ = self._matrix(buf[:split], self.rows, "P")
        q, _ = self._matrix(buf[split:], self.cols, "Q")
        with np.errstate(over="ignore", invalid="ignore"):  # any float32 bits are a valid payload
            return self._into(out, lambda target: self._product(p, q, target))


@register_reducer("powersgd")
class PowerSGDSums(PhasedSums):
    """PowerSGD's reduction: two phases, each a plain float32 sum over the workers (P, then Q).
    The communicator drives them with dense reduces of one buffer per phase
    (bps_gc/comm/phased.py), so no server ever holds a PowerSGD key or payload."""

    phase_sums = "P and Q phases are dense sums"
