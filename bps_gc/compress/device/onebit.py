"""onebit (signSGD, with or without scaling) on the device: the sign bits (1 = x < 0; +0, -0 and
NaN give 0) MSB first in words as wide as the element (16 bits for float16), each word
little-endian, then the float32 scale (compress/onebit.py, docs/codecs.md).

The bits are always byte-exact. The scale is ``float32(sum(|x|) / n)`` with the sum in
float64, like the C kernel; the C kernel sums eight index-interleaved lanes in sequence and
the device sums in its own order (a parallel reduction), so the float64 sums agree exactly
whenever no partial sum rounds (every sum of float32 magnitudes whose total stays below 2^53
times the smallest magnitude's last bit) and otherwise differ by float64 rounding, which
changes the float32 scale only when the mean lies that close to a float32 rounding boundary:
at most one float32 ulp (tests/test_device_chains.py bounds it)."""
import math

import torch

from ..onebit import Onebit
from .base import DeviceCodec
from .registry import register_device_compressor

BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # element t of a byte goes to bit 7 - t


@register_device_compressor("onebit")
class DeviceOnebit(DeviceCodec):
    host_class = Onebit
    reducers = Onebit.reducers

    def __init__(self, params, n, dtype, seed=None, device=None):
        super().__init__(params, n, dtype, seed, device)
        host = self.host_class(params, n, dtype)  # checks the dtype as the numpy codec does
        self.scaling = host.scaling
        self.words_bytes = host.words_bytes
        self.word_bytes = self.dtype.itemsize  # word width = element width
        self._weights = torch.tensor(BIT_WEIGHTS, dtype=torch.uint8, device=self.device)
        # octet -> its eight sign bits, MSB first: decoding is one gather
        self._octet_bits = (torch.arange(256, dtype=torch.uint8, device=self.device)
                            .view(-1, 1) & self._weights).ne(0)
        self._bits = torch.zeros(self.words_bytes * 8, dtype=torch.bool, device=self.device)

    def compress(self, x, ctx=None):
        x = self._input(x)
        torch.lt(x, 0, out=self._bits[: self.n])  # the padding stays 0
        grouped = self._bits.view(-1, 8).view(torch.uint8)
        octets = (grouped * self._weights).sum(1, dtype=torch.uint8)
        # bytes of a word in element order, stored little-endian: reverse them within the word
        words = octets.view(-1, self.word_bytes).flip(1).reshape(-1)
        # sum |x| in float64 in one pass (inf or NaN shows here too)
        total = torch.linalg.vector_norm(x, 1, dtype=torch.float64)
        if self.scaling:
            scale = (total / self.n).to(torch.float32)
        else:
            scale = torch.where(torch.isfinite(total), 1.0, math.nan).to(torch.float32)
        return torch.cat([words, scale.reshape(1).view(torch.uint8)])

    def _signs_and_scale(self, payload):
        buf = self._payload(payload, self.words_bytes + 4)
        scale = buf[self.words_bytes:].clone().view(torch.float32)  # clone: aligned
        octets = buf[: self.words_bytes].view(-1, self.word_bytes).flip(1).reshape(-1)
        negative = self._octet_bits[octets.long()].view(-1)[: self.n]
        pos = scale.to(self.torch_dtype)  # float32 -> float16 rounds (or overflows) as numpy's cast
        return negative, pos

    def decompress(self, payload, out=None):
        negative, pos = self._signs_and_scale(payload)
        out = self._output(out)
        torch.where(negative, -pos, pos, out=out)
        return out

    def residual(self, payload, x):
        x = self._inplace(x, "x")
        negative, pos = self._signs_and_scale(payload)
        x.sub_(torch.where(negative, -pos, pos))

    def decompress_add(self, payload, acc):
        acc = self._inplace(acc, "acc")
        negative, pos = self._signs_and_scale(payload)
        acc.add_(torch.where(negative, -pos, pos))
