"""thc on the device: compress/thc.py's two phases and payloads (the exponent histogram; the
header and packed lanes as float64 or int64 words), with the rotation, codes and error as tensors.

Cross-rank agreement: the histogram bin, the header, the lanes and the rotation's signs (drawn
by numpy's generator from the same seed, ``block`` values, copied to the device) are the numpy
chain's exactly; with ``feedback`` (round to nearest) the codes are too, up to the float32
Hadamard sums' order. Stochastic rounding draws torch's generator, seeded with the numpy chain's
``worker_seed`` (the seed, key and rank), so the codes differ from the numpy chain's draw for
draw, with the same distribution; each worker draws its own, and every launch the same.
"""
import math

import numpy as np
import torch

from .. import thc
from .base import DeviceCodec
from .quantize import device_generator, generator_kind
from .registry import register_device_compressor


def pack_lanes(codes, width, bits=thc.CARRIER_BITS):
    """int64 codes -> words, code j of a word at bit width * j (kernels/thc.c's layout; the
    codes are clamped to their lane by the caller): float64 words, or int64 ones for
    ``bits`` = 64 (the lanes are disjoint, so their sum is their bitwise or, wrapping into the
    sign bit as the C kernel's unsigned words do)."""
    k = thc.lanes_per_word(width, bits)
    padded = torch.zeros(thc.words_for(codes.numel(), width, bits) * k, dtype=torch.int64, device=codes.device)
    padded[:codes.numel()] = codes
    shifts = torch.arange(k, device=codes.device, dtype=torch.int64) * width
    words = (padded.view(-1, k) << shifts).sum(dim=1)
    return words if bits != thc.CARRIER_BITS else words.to(torch.float64)


def unpack_lanes(words, width, count):
    """Summed words (float64 or int64) -> the int64 lane sums."""
    bits = thc.CARRIER_BITS if words.dtype == torch.float64 else 64
    k, mask = thc.lanes_per_word(width, bits), (1 << width) - 1
    if bits == thc.CARRIER_BITS and words.numel() and (
            words.min() < 0 or words.max() >= 2.0 ** thc.CARRIER_BITS or not torch.equal(words, torch.floor(words))):
        raise ValueError("thc: a summed word is not an integer in [0, 2^53): a lane overflowed")
    shifts = torch.arange(k, device=words.device, dtype=torch.int64) * width
    # an arithmetic shift of a word read as signed keeps the lane's low bits: the mask takes them
    return ((words.to(torch.int64).view(-1, 1) >> shifts) & mask).reshape(-1)[:count]


@register_device_compressor("thc")
class DeviceTHC(DeviceCodec):
    reducers = thc.THC.reducers
    draws_per_worker = True
    state_attrs = ("generator", "error")  # as the other device codecs: torch's generator, not numpy's words

    def state_identity(self):
        return {**super().state_identity(), "rng": generator_kind(self.device)}

    def __init__(self, params, n, dtype, seed, device, **extra):
        super().__init__(params, n, dtype, seed, device)
        self.host = thc.THC(params, n, dtype, seed, extra.get("worker_seed"))  # options, sizes and checks
        self.bits, self.rotate, self.feedback = self.host.bits, self.host.rotate, self.host.feedback
        self.block, self.codes, self.levels = self.host.block, self.host.codes, self.host.levels
        f32 = dict(dtype=torch.float32, device=self.device)
        self.error = torch.zeros(self.n, **f32) if self.feedback else None
        self.generator = device_generator(self.host.worker_seed, self.device)
        self.x = self.y = self.signs = None

    def set_summands(self, summands, carrier=None):
        self.host.set_summands(summands, carrier)

    @property
    def phase_dtype(self):
        return self.host.phase_dtype

    @property
    def _words_dtype(self):
        return torch.float64 if self.host.phase_dtype == thc.CARRIER else torch.int64

    @property
    def summands(self):
        return self.host.summands

    @property
    def width(self):
        return self.host.width

    @property
    def phase_sizes(self):
        return self.host.phase_sizes

    def _rotate(self, x, inverse=False):
        return thc.rotated(x, self.signs, self.block, inverse, torch.cat)

    def compress(self, x, ctx=None):
        x = self._input(x).to(torch.float32)
        if self.feedback:
            x = x + self.error
        self.x = x
        if self.rotate:
            self.signs = torch.from_numpy(thc.rotation_signs(self.seed, ctx, self.block)).to(self.device)
            padded = torch.zeros(self.codes, dtype=torch.float32, device=self.device)
            padded[:self.n] = x
            self.y = self._rotate(padded)
        else:
            self.y = x
        peak = float(self.y.abs().max()) if self.y.numel() else 0.0  # NaN propagates through max
        words = thc.histogram_words(thc.exponent_bin(peak), self.summands, self.host.phase_dtype)
        return torch.from_numpy(words).to(self.device).view(torch.uint8)

    def _floats(self, buffer):
        """A summed phase buffer (bytes, numpy or a tensor) as words (float64 or int64) on the device."""
        dtype = self._words_dtype
        if isinstance(buffer, torch.Tensor):
            return buffer.reshape(-1).view(dtype).to(self.device) \
                if buffer.dtype == torch.uint8 else buffer.reshape(-1).to(self.device, dtype)
        return torch.from_numpy(np.array(np.asarray(buffer).reshape(-1).view(self.host.phase_dtype))).to(self.device)

    def agree(self, hist_sum):
        return self.host.agree(self._floats(hist_sum).cpu().numpy())

    def compress_q(self, hist_sum):
        exponent, nonfinite = self.agree(hist_sum)
        header = torch.tensor([self.bits, exponent, 1], dtype=self._words_dtype, device=self.device)
        if nonfinite:
            codes = torch.zeros(self.codes, dtype=torch.int64, device=self.device)
        else:
            scaled = (self.y.to(torch.float64) * 2.0 ** -exponent + 1) * (self.levels / 2)
            if self.feedback:
                codes = torch.floor(scaled + 0.5)  # ties up, as the C kernel
            else:
                noise = torch.rand(scaled.shape, generator=self.generator, device=self.device,
                                   dtype=torch.float64)
                codes = torch.floor(scaled + noise)
            codes = codes.clamp_(0, self.levels).to(torch.int64)
            if self.feedback:
                own = self._dequantize(codes, 1, exponent)
                self.error = self.x - (self._rotate(own, True)[:self.n] if self.rotate else own)
        return torch.cat([header, pack_lanes(codes, self.width, self.host.word_bits)]).view(torch.uint8)

    def _dequantize(self, code_sum, summands, exponent):
        return (2.0 ** exponent * (2.0 * code_sum.to(torch.float64) / self.levels - summands)).to(torch.float32)

    def finish(self, code_sum, out=None, workers=1):
        buf = self._floats(code_sum)
        self.host.check_sum(buf.numel(), buf[:thc.HEADER].cpu().numpy())
        exponent, nonfinite = self.host.agreed
        total = unpack_lanes(buf[thc.HEADER:], self.width, self.codes)
        out = self._output(out)
        if nonfinite:
            out.fill_(math.nan)
            return out
        values = self._dequantize(total, self.summands, exponent)
        if self.rotate:
            values = self._rotate(values, inverse=True)[:self.n]
        out.copy_(values)
        return out

    def decompress(self, payload, out=None):
        return self.finish(payload, out, self.summands)
