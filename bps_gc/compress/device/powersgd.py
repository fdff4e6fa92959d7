"""PowerSGD on the device: compress/powersgd.py's algorithm and phase payloads (P, then Q, as
row-major float32), with M, Q, P^ and the error kept as tensors on the device.

The two phases (bps_gc/comm/phased.py): ``compress(x)`` gives P = M Q, ``compress_q(p_sum)``
orthogonalizes the summed P and gives Q = M^T P^, ``finish(q_sum, out, workers)`` writes
P^ (sum Q)^T and keeps the error and the warm start. The summed buffers may be tensors on any
device, numpy arrays or bytes.

Cross-rank agreement: the sums need every worker to start from the same Q, which is the numpy
chain's seeded Gaussian matrix (numpy's generator, drawn once on the host, ``cols x rank``
floats) copied to the device; after that every worker derives P^ and the next Q from the same
sums. The products are float32 matrix products in the device library's order of summation,
and the orthogonalization is torch's Householder QR (LAPACK's convention, as numpy's): the
values agree with the numpy chain to float32 rounding, not bit for bit, so ranks of one job
should run one kind of chain (numpy or device) for PowerSGD tensors.
"""
import numpy as np
import torch

from ..powersgd import matrix_identity, matrix_shape
from .base import DeviceCodec
from .registry import register_device_compressor


@register_device_compressor("powersgd")
class DevicePowerSGD(DeviceCodec):
    reducers = ("powersgd",)
    takes_shape = True
    state_attrs = ("q", "error")  # as the numpy codec's

    def state_identity(self):
        return matrix_identity(self, super().state_identity())

    def __init__(self, params, n, dtype, seed, device, shape=None, **extra):
        super().__init__(params, n, dtype, seed, device)
        if self.dtype not in (np.float32, np.float16):
            raise TypeError(f"powersgd: float32 or float16 partitions only, got {self.dtype}")
        self.rows, self.cols = matrix_shape(self.n, shape)
        self.rank = min(int(dict(params.options).get("rank", 1)), self.rows, self.cols)
        start = np.random.default_rng(int(seed)).standard_normal((self.cols, self.rank))
        self.q = torch.from_numpy(start.astype(np.float32)).to(self.device)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.error = torch.zeros(self.n, **f32)
        self.m = torch.zeros(self.rows, self.cols, **f32)  # the padding stays zero
        self.p_hat = None

    @property
    def phase_sizes(self):
        """float32 elements of each phase's payload: P, then Q."""
        return self.rows * self.rank, self.cols * self.rank

    def _matrix(self, summed, rows, what):
        """A phase payload (float32 values or their bytes; tensor, numpy array or bytes) as a
        rows x rank float32 matrix on the device."""
        if isinstance(summed, torch.Tensor) and summed.dtype == torch.float32:
            summed = summed.reshape(-1).view(torch.uint8)
        elif isinstance(summed, np.ndarray) and summed.dtype == np.float32:
            summed = summed.reshape(-1).view(np.uint8)
        buf = self._payload(summed, rows * self.rank * 4)
        try:
            return buf.view(torch.float32).view(rows, self.rank)
        except RuntimeError:  # a slice at an offset not a multiple of 4 bytes
            return buf.clone().view(torch.float32).view(rows, self.rank)

    @staticmethod
    def _bytes(matrix):
        return matrix.contiguous().view(-1).view(torch.uint8)

    def compress(self, x, ctx=None):
        x = self._input(x).to(torch.float32)
        flat = self.m.view(-1)
        torch.add(x, self.error, out=flat[: self.n])
        return self._bytes(self.m @ self.q)

    def compress_q(self, p_sum):
        p = self._matrix(p_sum, self.rows, "P")
        self.p_hat = torch.linalg.qr(p).Q.contiguous()
        return self._bytes(self.m.T @ self.p_hat)

    def finish(self, q_sum, out=None, workers=1):
        if self.p_hat is None:
            raise ValueError("powersgd: finish() before compress_q()")
        q = self._matrix(q_sum, self.cols, "Q").clone()
        approx = (self.p_hat @ q.T).view(-1)[: self.n]
        # error = M - approx / workers, as the numpy kernel (approx * (-1/workers) + M); a
        # non-finite step shows in out and leaves a zero error (no device-to-host read)
        error = approx * np.float32(-1.0 / workers).item() + self.m.view(-1)[: self.n]
        self.error = torch.where(torch.isfinite(error).all(), error, torch.zeros_like(error))
        out = self._output(out)
        out.copy_(approx)
        # the warm start only from a finite sum: one NaN step must not stop every later one
        # (the numpy chain keeps a NaN Q, so its later steps all come out NaN)
        self.q = torch.where(torch.isfinite(q).all(), q, self.q)
        return out

    def decompress(self, payload, out=None):
        split = self.rows * self.rank * 4
        buf = self._payload(payload, split + self.cols * self.rank * 4)
        p = self._matrix(buf[:split], self.rows, "P")
        q = self._matrix(buf[split:], self.cols, "Q")
        out = self._output(out)
        out.copy_((p @ q.T).view(-1)[: self.n])
        return out
