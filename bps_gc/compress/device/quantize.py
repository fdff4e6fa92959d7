"""TernGrad and QSGD on the device: compress/quantize.py's payloads (a float32 scale, then
2-bit TernGrad codes or QSGD's bit-packed (level, sign) codes).

The Bernoulli draws come from the device's generator (a ``torch.Generator`` on the device,
seeded with the codec's seed), not from the numpy chain's xorshift128+: the draws of the
elements are independent of one another and need no agreement between ranks (each rank's
payload decodes alone), and a sequential generator would serialize the device. The payloads
therefore have the numpy chain's format and distribution, not its bytes. Each draw is a float64
uniform ``u`` and an element is rounded up when ``u < p``: unbiased to 2^-53 (numpy's 32-bit
draws: 2^-32).
"""
import math

import numpy as np
import torch

from ..quantize import F32_MAX, qsgd_bits
from .base import DeviceCodec
from .registry import register_device_compressor

HEADER = 4  # the float32 scale


def device_generator(seed, device):
    """A generator on ``device`` seeded with ``seed``: the codec's (the same on every rank, as
    the numpy chain's xorshift128+), or thc's ``worker_seed`` (its rank's own)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
    return gen


def generator_kind(device):
    """The identity of a device generator's state (its layout differs per device type, and
    from the numpy codecs' xorshift128+)."""
    return f"torch.Generator({device.type})"


def float32_bytes(value):
    """A float32 scalar tensor's 4 bytes (uint8, same device)."""
    return value.reshape(1).to(torch.float32).view(torch.uint8)


class DeviceStochasticQuantizer(DeviceCodec):
    """Shared: float32/float16 only, the generator, the float32 header, decoding into float16."""

    state_attrs = ("generator",)

    def state_identity(self):
        return {**super().state_identity(), "rng": generator_kind(self.device)}

    def __init__(self, params, n, dtype, seed, device, **extra):
        super().__init__(params, n, dtype, seed, device)
        if self.dtype not in (np.float32, np.float16):
            raise TypeError(f"{type(self).__name__}: float32 or float16 partitions only, got {self.dtype}")
        self.generator = device_generator(seed, self.device)
        self.body_bytes = None  # set by subclasses

    def _as_f32(self, x):
        return self._input(x).to(torch.float32)

    def _uniform(self):
        return torch.rand(self.n, dtype=torch.float64, device=self.device, generator=self.generator)

    def _split(self, payload):
        buf = self._payload(payload, HEADER + self.body_bytes)
        # clone: a payload cut from a gathered buffer may start off a float32's alignment
        return buf[:HEADER].clone().view(torch.float32), buf[HEADER:]

    def _finish_decode(self, out, values, bad):
        """out = values (float32, converted to float16 partitions); ``bad``: a device bool,
        true for a malformed payload (checked before anything is written)."""
        if bool(bad):
            raise ValueError(f"{type(self).__name__}: malformed payload (a code out of range "
                             "or nonzero padding bits)")
        out = self._output(out)
        out.copy_(values)
        return out


@register_device_compressor("terngrad")
class DeviceTernGrad(DeviceStochasticQuantizer):
    """s = max|x| (clipped to 2.5 standard deviations with ``clip``), t_i = sign(x_i) *
    Bernoulli(min(|x_i|, c) / s); codes 0 zero, 1 +1, 2 -1, four to a byte from the low bits."""

    def __init__(self, params, n, dtype, seed, device, **extra):
        super().__init__(params, n, dtype, seed, device)
        self.clip = bool(dict(params.options).get("clip", False))
        self.body_bytes = -(-self.n // 4)

    def compress(self, x, ctx=None):
        x = self._as_f32(x)
        a = x.abs()
        peak = a.max()  # NaN when any element is NaN (numpy's key max: the same)
        bound = torch.full((), math.inf, dtype=torch.float32, device=self.device)
        if self.clip:
            wide = x.to(torch.float64)
            mean = wide.sum() / self.n
            var = ((wide * wide).sum() / self.n - mean * mean).clamp_min(0)
            bound = torch.where(torch.isfinite(peak), (2.5 * var.sqrt()).to(torch.float32), bound)
        scale = torch.minimum(peak, bound)
        usable = torch.isfinite(peak) & (scale > 0)
        safe = torch.where(usable, scale, torch.ones_like(scale))
        p = torch.minimum(a, bound) / safe  # float32, as the kernel
        keep = (self._uniform() < p) & usable
        codes = keep.to(torch.uint8) * (1 + torch.signbit(x).to(torch.uint8))
        codes = torch.nn.functional.pad(codes, (0, 4 * self.body_bytes - self.n)).view(-1, 4)
        body = codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6
        header = torch.where(torch.isfinite(peak), scale, torch.full_like(scale, math.nan))
        return torch.cat([float32_bytes(header), body])

    def decompress(self, payload, out=None):
        scale, body = self._split(payload)
        codes = torch.stack([(body >> s) & 3 for s in (0, 2, 4, 6)], 1).reshape(-1)
        bad = (codes == 3).any() | (codes[self.n:] != 0).any()
        table = torch.cat([scale * 0, scale, -scale, scale * 0])  # 0 * NaN: NaN, as the kernel
        return self._finish_decode(out, table[codes[: self.n].long()], bad)


@register_device_compressor("qsgd")
class DeviceQSGD(DeviceStochasticQuantizer):
    """l_i = Q |x_i| / ||x||_2; level = floor(l) + Bernoulli(l - floor(l)) (at most Q); code
    (level << 1 | sign), ``bits`` wide, packed from the least significant bit of a little-endian
    bit stream; decodes to sign * level * float32(norm / (Q tau))."""

    def __init__(self, params, n, dtype, seed, device, **extra):
        super().__init__(params, n, dtype, seed, device)
        options = dict(params.options)
        self.levels = int(options.get("levels", 255))
        self.biased = bool(options.get("biased", False))
        self.bits = qsgd_bits(self.levels)
        self.body_bytes = -(-self.n * self.bits // 8)
        q = self.levels
        self.tau = 1.0 + min(self.n / q / q, math.sqrt(self.n) / q) if self.biased else 1.0
        # element i's code starts at bit i * bits: its byte and the shift within it
        pos = torch.arange(self.n, dtype=torch.int64, device=self.device) * self.bits
        self._byte, self._shift = pos >> 3, pos & 7

    def compress(self, x, ctx=None):
        x = self._as_f32(x)
        wide = x.to(torch.float64)
        norm = (wide * wide).sum().sqrt()  # float64, like the kernel's moments (order differs)
        finite = torch.isfinite(norm)
        stored = torch.where(finite, norm.clamp_max(F32_MAX), torch.full_like(norm, math.nan))
        stored = stored.to(torch.float32)
        usable = finite & (norm > 0)
        # as the kernel: mult = float32(Q / norm), l = |x| * mult in float32; a partition of
        # subnormals (Q / norm past float32's range) is scaled up by 2^100 first, exactly
        norm = torch.where(usable, norm, torch.ones_like(norm))
        up = torch.where(self.levels / norm > F32_MAX, 2.0**100, 1.0)
        mult = (self.levels / (norm * up)).to(torch.float32)
        level_f = (x * up.to(torch.float32)).abs() * mult
        floor = level_f.floor()
        level = floor.to(torch.float64) + (self._uniform() < (level_f - floor)).to(torch.float64)
        level = level.clamp_max(self.levels).to(torch.int64)
        level = torch.where(usable, level, torch.zeros_like(level))
        codes = level << 1 | (torch.signbit(x) & (level != 0)).to(torch.int64)
        return torch.cat([float32_bytes(stored), self._pack(codes)])

    def _pack(self, codes):
        """The codes as a little-endian bit stream: each code (at most 25 bits, shifted by at
        most 7) adds its bits to at most four bytes; the bits are disjoint, so sums are ORs."""
        placed = codes << self._shift
        acc = torch.zeros(self.body_bytes + 4, dtype=torch.int32, device=self.device)
        for b in range(4):
            acc.index_add_(0, self._byte + b, ((placed >> (8 * b)) & 0xFF).to(torch.int32))
        return acc[: self.body_bytes].to(torch.uint8)

    def decompress(self, payload, out=None):
        norm, body = self._split(payload)
        padded = torch.nn.functional.pad(body, (0, 4)).to(torch.int64)
        word = (padded[self._byte] | padded[self._byte + 1] << 8 | padded[self._byte + 2] << 16
                | padded[self._byte + 3] << 24)
        codes = (word >> self._shift) & ((1 << self.bits) - 1)
        used = self.n * self.bits
        bad = (codes > (self.levels << 1 | 1)).any()
        if used & 7:
            bad = bad | ((body[-1] >> (used & 7)) != 0)
        divisor = torch.full((), self.levels * self.tau, dtype=torch.float64, device=self.device)
        scale = (norm.to(torch.float64) / divisor).to(torch.float32)  # not by a reciprocal
        values = (codes >> 1).to(torch.float32) * scale
        return self._finish_decode(out, torch.where((codes & 1).bool(), -values, values), bad)
