"""dithering on the device: compress/dithering.py's payload (for each nonzero level, Elias-delta
of the index gap, the sign bit, Elias-delta of the level, MSB first in words of ``W``; then the
bit count as ``W`` and the scale as float32).

Encoding runs on the device: levels and their probabilities per element as the numpy kernel
computes them, one draw per element from the device's generator (float64 uniforms: unbiased to
2^-53), then the codes of the nonzero levels are placed at their bit offsets (a prefix sum of
their lengths) in one pass. The draws need no agreement between ranks, so the payload has the
numpy chain's format and distribution, not its bytes; where no element is random (every level
an integer) it is the numpy chain's byte for byte.

Decoding: the numpy kernel reads the stream once (the same checks and values), on the host.
``parse_stream`` decodes on the device instead, although the stream is a chain of
variable-length codes whose starts are known only one after another; on an H200 it was the
slower of the two, so it runs only where ``parallel_decode`` is set.
"""
import math

import numpy as np
import torch

from ..dithering import Dithering
from .base import DeviceCodec, host_array
from .quantize import device_generator, generator_kind
from .registry import register_device_compressor


def elias_delta(v):
    """(code, length) of Elias-delta(v) for int64 v >= 1 (below 2^53): L zeros, then
    N = bit_length(v) in L + 1 bits, then v's low N - 1 bits, i.e. (N-1) 2^(N-1) + v in
    2L + N bits (kernels/bitstream.h)."""
    big_n = torch.frexp(v.to(torch.float64)).exponent.to(torch.int64)  # bit_length(v)
    big_l = torch.frexp(big_n.to(torch.float64)).exponent.to(torch.int64) - 1
    return ((big_n - 1) << (big_n - 1)) + v, 2 * big_l + big_n


def write_bits(codes, lengths):
    """The codes (int64, each at most 56 bits) one after another, MSB first, as 64-bit chunks
    (int64 bit patterns) and the total bit count (an int). The bits of different codes are
    disjoint, so adding them into the chunks is OR-ing."""
    ends = torch.cumsum(lengths, 0)
    total = int(ends[-1]) if ends.numel() else 0
    chunks = torch.zeros(total // 64 + 2, dtype=torch.int64, device=codes.device)
    if not total:
        return chunks[:0], 0
    starts = ends - lengths
    chunk, over = starts >> 6, (starts & 63) + lengths - 64  # over > 0: runs into chunk + 1
    head = torch.where(over <= 0, codes << (-over).clamp_min(0), codes >> over.clamp_min(0))
    tail = torch.where(over > 0, codes << (64 - over).clamp(0, 63), torch.zeros_like(codes))
    chunks.index_add_(0, chunk, head)
    chunks.index_add_(0, chunk + 1, tail)
    return chunks[: -(-total // 64)], total


@register_device_compressor("dithering")
class DeviceDithering(DeviceCodec):
    """Linear (``s`` levels) or natural (powers of two up to 2^(s-1)) stochastic levels of
    |x| / S, S the max or the l2 norm; see the module doc for where each part runs."""

    state_attrs = ("generator",)  # self.host's generator is never drawn from

    def state_identity(self):
        return {**super().state_identity(), "rng": generator_kind(self.device)}

    def __init__(self, params, n, dtype, seed, device, **extra):
        super().__init__(params, n, dtype, seed, device)
        self.s = int(params.k)
        self.natural = params.partition == "natural"
        self.level = float(2 ** (self.s - 1) if self.natural else self.s)
        self.l2 = params.normalize == "l2"
        self.word_bits = 64 if self.dtype == np.float64 else 32  # float16: 32-bit words
        self.generator = device_generator(seed, self.device)
        self.host = Dithering(params, n, dtype, seed)  # its non-finite payload, CPU decoding
        # The numpy kernel decodes (reading the stream once; off the CPU into a host buffer,
        # then one copy to the device): on an H200 the parallel parse decoded 0.57 GB/s at 25M
        # elements, host copy + the kernel 1.65 (docs/device_codecs.md). The parse stays
        # selectable (parallel_decode = True) and tested.
        self.parallel_decode = False
        self._staging = None

    def compress(self, x, ctx=None):
        x = self._input(x)
        x = x if self.dtype == np.float64 else x.to(torch.float32)  # the f32 kernel's input
        scale = float(((x * x).to(torch.float64).sum().sqrt() if self.l2
                       else x.abs().max().to(torch.float64)))
        if not math.isfinite(scale):
            return self._nonfinite_payload()
        if scale == 0:
            return self._payload_of(torch.zeros(0, dtype=torch.int64, device=self.device), 0, 0.0)
        draws = torch.rand(self.n, dtype=torch.float64, device=self.device, generator=self.generator)
        divisor = torch.full((), scale, dtype=torch.float64, device=self.device)  # see decompress
        u = x.abs().to(torch.float64) / divisor * self.level
        if self.natural:  # between the powers of two fl and 2 fl (0 and 1 below 1)
            ceil = u.ceil()
            floor = torch.where(ceil > 1, torch.exp2(torch.frexp(ceil - 1).exponent - 1.0),
                                torch.zeros_like(u))
            width = torch.where(floor > 0, floor, torch.ones_like(u))
            levels = floor + width * (draws < (u - floor) / width)
        else:  # the kernel rounds u to float32 first
            u = u.to(torch.float32)
            floor = u.floor()
            levels = floor.to(torch.float64) + (draws < (u - floor).to(torch.float64))
        levels = levels.to(torch.int64)
        idx = levels.nonzero().reshape(-1)
        if not idx.numel():
            return self._payload_of(torch.zeros(0, dtype=torch.int64, device=self.device), 0, scale)
        gap_code, gap_len = elias_delta(torch.diff(idx, prepend=idx.new_full((1,), -1)))
        level_code, level_len = elias_delta(levels[idx])
        sign = torch.signbit(x[idx]).to(torch.int64)
        codes = torch.stack([gap_code, sign << level_len | level_code], 1).reshape(-1)
        lengths = torch.stack([gap_len, level_len + 1], 1).reshape(-1)
        chunks, total = write_bits(codes, lengths)
        return self._payload_of(chunks, total, scale)

    def _payload_of(self, chunks, total, scale):
        """The words of the stream (``chunks``: 64-bit, MSB first), the bit count as a word and
        the float32 scale, as a uint8 tensor."""
        if self.word_bits == 32:
            halves = torch.stack([(chunks >> 32) & 0xFFFFFFFF, chunks & 0xFFFFFFFF], 1).reshape(-1)
            words = halves[: -(-total // 32)]
            words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
            count = torch.tensor([total], dtype=torch.int32)
        else:
            words, count = chunks, torch.tensor([total], dtype=torch.int64)
        tail = torch.cat([count.view(torch.uint8),
                          torch.tensor([scale], dtype=torch.float32).view(torch.uint8)])
        return torch.cat([words.view(torch.uint8), tail.to(self.device)])

    def _nonfinite_payload(self):
        # the numpy codec's: one entry (index 0, level 1) and a NaN scale
        return torch.from_numpy(self.host._nonfinite_payload()).to(self.device)

    def decompress(self, payload, out=None):
        if not self.parallel_decode:
            out = self._output(out)
            if out.device.type == "cpu":
                self.host.decompress(host_array(payload), out.detach().numpy())  # writes into out
            else:  # into a host buffer kept from call to call (a fresh one costs its page faults)
                if self._staging is None or self._staging.dtype != out.dtype:
                    self._staging = torch.empty(self.n, dtype=out.dtype)
                self.host.decompress(host_array(payload), self._staging.numpy())
                out.copy_(self._staging.view(out.shape))  # from pageable memory: synchronous
            return out
        buf = self._payload(payload)
        wb = self.word_bits // 8
        if buf.numel() < wb + 4 or (buf.numel() - 4) % wb:
            raise ValueError(f"dithering: truncated payload ({buf.numel()} bytes)")
        nwords = (buf.numel() - 4) // wb - 1
        stream = buf[: nwords * wb]
        total = int(buf[nwords * wb: (nwords + 1) * wb].contiguous().view(
            torch.int32 if wb == 4 else torch.int64)[0])
        if not 0 <= total <= nwords * self.word_bits:
            raise ValueError("dithering: truncated payload (bit count past its words)")
        scale = buf[-4:].contiguous().view(torch.float32)
        idx, levels, negative = parse_stream(stream, wb, total, self.n)
        # a divisor on the device: CUDA multiplies by the reciprocal of a host scalar instead
        levels_f32 = torch.full((), self.level, dtype=torch.float32, device=self.device)
        values = (levels.to(torch.float32) * scale) / levels_f32
        out = self._output(out)
        out.zero_()
        out[idx] = torch.where(negative, -values, values).to(out.dtype)
        return out


PARSE_BLOCK = 1 << 22  # bit positions parsed at once: bounds the temporaries (~100 bytes each)


def elias_at(be, pos):
    """(window, length, value, valid) of an Elias-delta code starting at each bit position
    ``pos`` of the big-endian bytes ``be`` (int64, 16 zero bytes of padding): the 64 bits from
    there, the code's length and value, and whether it has at most 5 leading zeros and at most
    57 bits (kernels/bitstream.h, elias_peek)."""
    byte, off = pos >> 3, pos & 7
    head = torch.zeros_like(pos)
    for b in range(8):
        head |= be[byte + b] << (56 - 8 * b)
    window = head << off | be[byte + 8] >> (8 - off)
    top6 = (window >> 58) & 63
    zeros = torch.where(top6 > 0, 6 - torch.frexp(top6.to(torch.float64)).exponent.to(torch.int64),
                        torch.full_like(top6, 6))  # leading zeros; 6: more than 5
    big_l = zeros.clamp_max(5)
    big_n = (window >> (63 - 2 * big_l)) & ((2 << big_l) - 1)
    length = 2 * big_l + big_n
    low_bits = (big_n - 1).clamp(0, 56)
    value = (1 << low_bits) | (window >> (64 - length).clamp(0, 63)) & ((1 << low_bits) - 1)
    return window, length, value, (zeros <= 5) & (length <= 57)


def triple_at(be, pos, total):
    """(gap, length, negative, level, ok) of a (gap, sign, level) triple starting at each bit
    position ``pos``; ``ok`` as the numpy kernel's checks: the gap's code within its 57-bit
    window from the byte boundary, the level's code within 56 bits, both before ``total``."""
    window, gap_len, gap, gap_ok = elias_at(be, pos)
    _, level_len, level, level_ok = elias_at(be, (pos + gap_len + 1).clamp_max(total - 1))
    ok = gap_ok & (gap_len + (pos & 7) <= 57) & level_ok & (level_len <= 56) \
        & (pos + gap_len + 1 < total)
    negative = ((window >> (63 - gap_len.clamp_max(63))) & 1).bool()  # the bit after the gap
    return gap, gap_len + 1 + level_len, negative, level, ok


def parse_stream(stream, word_bytes, total, n):
    """(indices, levels, negative) of the (gap, sign, level) triples in the first ``total``
    bits of ``stream`` (uint8 words of ``word_bytes``, each MSB first), on its device.

    The triples are variable-length codes, so where each starts is known only from the one
    before. Every bit position is parsed as if a triple started there, which gives the next
    start ``nxt[p]``; the real starts are the positions reachable from 0, marked by pointer
    doubling (round r marks the first 2^r of them). Malformed streams raise ValueError where
    the numpy kernel's checks fail (triple_at; the last triple must end at the bit count; the
    indices stay below n)."""
    device = stream.device
    if total == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty, empty.bool()
    be = stream.view(-1, word_bytes).flip(1).reshape(-1).to(torch.int64)  # big-endian bytes
    be = torch.nn.functional.pad(be, (0, 16))
    end, error = total, total + 1  # absorbing: the stream's end, and a malformed triple
    nxt = torch.empty(total + 2, dtype=torch.int64, device=device)
    for first in range(0, total, PARSE_BLOCK):
        pos = torch.arange(first, min(total, first + PARSE_BLOCK), device=device)
        _, length, _, _, ok = triple_at(be, pos, total)
        nxt[first: first + pos.numel()] = torch.where(ok, pos + length, error).clamp_max(error)
    nxt[end], nxt[error] = end, error
    reached = torch.zeros(total + 2, dtype=torch.bool, device=device)
    reached[0] = True
    hits = torch.empty(total + 2, dtype=torch.int32, device=device)
    while not bool(reached[end] | reached[error]):  # at most log2(total) + 1 rounds
        hits.zero_().index_add_(0, nxt, reached.to(torch.int32))
        reached |= hits > 0
        nxt = nxt[nxt]
    if bool(reached[error]):
        raise ValueError("dithering: malformed bit stream")
    gap, _, negative, level, _ = triple_at(be, reached[:total].nonzero().reshape(-1), total)
    idx = torch.cumsum(gap, 0) - 1
    if bool(idx[-1] >= n):
        raise ValueError("dithering: index out of range")
    return idx, level, negative
