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
        weights = torch.tensor(BIT_WEIGHTS, dtype=torch.uint8, device=self.device)
        # octet -> its eight sign bits, MSB first: decoding is one gather of table rows
        self._octet_bits = (torch.arange(256, dtype=torch.uint8, device=self.device)
                            .view(-1, 1) & weights).ne(0)
        self._bits = torch.zeros(self.words_bytes * 8, dtype=torch.bool, device=self.device)

    def compress(self, x, ctx=None):
        x = self._input(x)
        torch.lt(x, 0, out=self._bits[: self.n])  # the padding stays 0
        # eight sign bytes (0/1, element j at bit 8j of a little-endian int64) -> one octet with
        # element j at bit 7 - j: OR-ing shifted copies puts element j at bit 63 - j (shifts
        # past bit 63 drop out; torch shifts integers as unsigned)
        v = self._bits.view(torch.int64)
        v = v | (v << 9)
        v = v | (v << 18)
        v = v | (v << 36)
        octets = ((v >> 56) & 0xFF).to(torch.uint8)
        # bytes of a word in element order, stored little-endian: reverse them within the word
        words = octets.view(-1, self.word_bytes).flip(1).reshape(-1)
        total = torch.sum(x.abs(), dtype=torch.float64)  # inf or NaN shows here too
        if self.scaling:
            scale = (total / self.n).to(torch.float32)
        else:
            scale = torch.where(torch.isfinite(total), 1.0, math.nan).to(torch.float32)
        return torch.cat([words, scale.reshape(1).view(torch.uint8)])

    def _octet_values(self, payload):
        """(octets in element order as int64, the (256, 8) table of their decoded values)."""
        buf = self._payload(payload, self.words_bytes + 4)
        scale = buf[self.words_bytes:].clone().view(torch.float32)  # clone: aligned
        octets = buf[: self.words_bytes].view(-1, self.word_bytes).flip(1).reshape(-1).long()
        pos = scale.to(self.torch_dtype)  # float32 -> float16 rounds (or overflows) as numpy's cast
        return octets, torch.where(self._octet_bits, -pos, pos)  # -pos: as the C kernel's negation

    def decompress(self, payload, out=None):
        octets, table = self._octet_values(payload)
        out = self._output(out)
        whole = self.n // 8  # whole octets go straight into out; the last one's first bits after
        if whole:
            torch.index_select(table, 0, octets[:whole], out=out[: whole * 8].view(whole, 8))
        if self.n > whole * 8:
            out[whole * 8:] = table[octets[whole]][: self.n - whole * 8]
        return out

    def residual(self, payload, x):
        x = self._inplace(x, "x")
        x.sub_(self.decompress(payload, self._scratch_tensor()))

    def decompress_add(self, payload, acc):
        acc = self._inplace(acc, "acc")
        acc.add_(self.decompress(payload, self._scratch_tensor()))
