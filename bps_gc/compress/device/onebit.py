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
from .base import DeviceCodec, shared_tensor
from .registry import register_device_compressor

BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # element t of a byte goes to bit 7 - t


OCTET_BITS = {}  # device -> its table (constant: every codec on the device reads the one)


def octet_bits(device):
    """The (256, 8) bool table of an octet's eight sign bits, MSB first, on ``device``: decoding
    is one gather of its rows."""
    if device not in OCTET_BITS:
        weights = torch.tensor(BIT_WEIGHTS, dtype=torch.uint8, device=device)
        OCTET_BITS[device] = (torch.arange(256, dtype=torch.uint8, device=device).view(-1, 1) & weights).ne(0)
    return OCTET_BITS[device]


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
        self._bits = None  # the signs, padded to whole words: made at the first compress

    def _sign_bits(self):
        """A bool tensor of the whole words' elements whose padding is 0: a shared scratch's
        (its padding cleared each call), else its own (cleared once)."""
        size = self.words_bytes * 8
        if self.scratch is not None:
            bits = shared_tensor(self.scratch, "onebit.bits", size, torch.bool, self.device)
            bits[self.n:].zero_()
            return bits
        if self._bits is None:
            self._bits = torch.zeros(size, dtype=torch.bool, device=self.device)
        return self._bits

    def compress(self, x, ctx=None):
        x = self._input(x)
        bits = self._sign_bits()
        torch.lt(x, 0, out=bits[: self.n])
        # eight sign bytes (0/1, element j at bit 8j of a little-endian int64) -> one octet with
        # element j at bit 7 - j: OR-ing shifted copies puts element j at bit 63 - j (shifts
        # past bit 63 drop out; torch shifts integers as unsigned)
        v = bits.view(torch.int64)
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
        return octets, torch.where(octet_bits(self.device), -pos, pos)  # -pos: as the C kernel's negation

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
