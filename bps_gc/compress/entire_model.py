"""Entire-model granularity (algorithms.md section 3): one codec run over all of a step's
gradients, its payload cut into per-chunk payloads of the same codec.

The bindings (``bps_gc.algorithms.entire_model``) concatenate the gradients into one vector,
declare it as chunks (tensors of at most one partition each, which the placement spreads over
the servers), and run ``WholeVectorCodec.compress`` over the vector: the codec chain (momentum,
error feedback, codec) sees the whole vector once, so there is one top-k, one threshold, one
norm or max. Its payload is cut at the chunk boundaries (multiples of ``ALIGN`` elements) into
payloads that the same codec decodes, for a chunk's element count, to exactly that chunk of the
whole decoding:

* records (topk, randomk) and sorted records (threshold, adaptive_threshold, dgc): the records
  whose index falls in the chunk, index minus the chunk start (none at all: an empty payload);
* onebit, sign, signnorm, terngrad, qsgd: the chunk's bits or codes (byte-aligned there) behind
  or in front of the one scale or norm;
* dithering: the chunk's entries written again as Elias-delta (gap, sign, level) with the one
  scale (the stream has no byte-aligned cut points).

The worker's transport then pushes each chunk: its codec, built by ``build_chain`` for
``granularity: entiremodel`` on a worker, is an ``EntireModelSlice`` that hands over the cut
payload left for it in ``PENDING`` under the step context's ``entiremodel_group`` and
``entiremodel_chunk``. Servers and decoders build the ordinary codec of a chunk, so a reducer
(``lossless`` by choice of the binding, or ``recompress``, which re-encodes per chunk) needs
nothing new, and neither does the transport.
"""
import dataclasses
import threading

import numpy as np

from ._native import check, ptr
from .base import Codec
from .chain import SLICE_CODECS, build_chain
from .dithering import Dithering
from .feedback import Forwarding
from .onebit import WORD_BITS, Onebit
from .quantize import QSGD, TernGrad
from .registry import COMPRESSORS, load_plugins
from .sparse import SparseCodec
from .stateful import Stateful
from .threshold import SortedSparse

ALIGN = 64  # chunk starts: whole 64-bit words of sign bits, whole bytes of 2-bit or qsgd codes
GROUP_KEY, CHUNK_KEY = "entiremodel_group", "entiremodel_chunk"
PENDING = {}  # (group, chunk) -> payload, from WholeVectorCodec.compress to the chunk's codec
_pending_lock = threading.Lock()


def layerwise(params, **changes):
    return dataclasses.replace(params, granularity="layerwise", **changes)


def check_splittable(params):
    """Raise a ValueError naming the codec when its payload cannot be cut into chunks."""
    load_plugins()
    cls = COMPRESSORS[params.compressor]
    if issubclass(cls, QSGD) and dict(params.options).get("biased"):
        raise ValueError("granularity 'entiremodel' with qsgd 'biased': its decoder divides by "
                         "tau(n) of the element count it decodes, which differs per chunk; use "
                         "the unbiased qsgd or layerwise")
    if not issubclass(cls, (SortedSparse, SparseCodec, Onebit, TernGrad, QSGD, Dithering)):
        raise ValueError(f"granularity 'entiremodel' cannot cut {params.compressor!r} payloads "
                         "into chunks (it knows topk, randomk, threshold, adaptive_threshold, "
                         "dgc, onebit, sign, signnorm, terngrad, qsgd and dithering); use "
                         "granularity 'layerwise'")


class WholeVectorCodec(Stateful):
    """The codec chain of a whole flattened model (``total`` elements of ``dtype``), and the
    cutting of its payloads at ``bounds`` (a list of (start, stop), starts multiples of
    ALIGN). Its state is the chain's (the decoder keeps none)."""

    def state_children(self):
        return (("", self.chain),)

    def __init__(self, params, total, dtype, bounds, key):
        check_splittable(params)
        self.params, self.total, self.dtype = params, int(total), np.dtype(dtype)
        self.bounds = list(bounds)
        if any(start % ALIGN for start, _ in self.bounds):
            raise ValueError(f"entiremodel chunks must start at multiples of {ALIGN} elements")
        self.chain = build_chain(layerwise(params), self.total, self.dtype, key=key, role="worker")
        bare = layerwise(params, ef=None, momentum=None, mu=None)
        self.decoder = build_chain(bare, self.total, self.dtype, key=key, role="server")

    def compress(self, flat, ctx):
        """The payload of every chunk, for the whole vector ``flat``."""
        return self.split(self.chain.compress(flat, ctx))

    def split(self, payload):
        codec = self.decoder
        buf = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) \
            else payload.reshape(-1).view(np.uint8)
        if isinstance(codec, (SortedSparse, SparseCodec)):
            return self._records(buf, codec.record, sorted_=isinstance(codec, SortedSparse))
        if isinstance(codec, Onebit):
            bits = WORD_BITS[self.dtype.type]
            return [np.concatenate([buf[start // 8: -(-stop // bits) * bits // 8], buf[-4:]])
                    for start, stop in self.bounds]
        if isinstance(codec, TernGrad):
            return [np.concatenate([buf[:4], buf[4 + start // 4: 4 + -(-stop // 4)]])
                    for start, stop in self.bounds]
        if isinstance(codec, QSGD):
            b = codec.bits
            return [np.concatenate([buf[:4], buf[4 + start * b // 8: 4 + -(-stop * b // 8)]])
                    for start, stop in self.bounds]
        return self._dithering(buf, codec)

    def _records(self, buf, record, sorted_):
        rec = np.frombuffer(np.ascontiguousarray(buf), record)
        order = None if sorted_ else np.argsort(rec["i"], kind="stable")
        keys = rec["i"] if sorted_ else rec["i"][order]
        starts = np.array([start for start, _ in self.bounds] + [self.total], np.int64)
        cuts = np.searchsorted(keys, starts)
        out = []
        for c, (start, _) in enumerate(self.bounds):
            if sorted_:
                part = rec[cuts[c]:cuts[c + 1]].copy()
            else:  # the records in their sent order
                part = rec[np.sort(order[cuts[c]:cuts[c + 1]])]
            part["i"] -= part["i"].dtype.type(start)
            out.append(part.view(np.uint8))
        return out

    def _dithering(self, buf, codec):
        word = np.dtype(np.uint64 if self.dtype == np.float64 else np.uint32)
        scale = np.float32(buf[-4:].view(np.float32)[0])
        if not np.isfinite(scale):  # a non-finite gradient: every chunk shows it
            return [codec._nonfinite_payload() for _ in self.bounds]
        values = np.empty(self.total, np.float64 if self.dtype == np.float64 else np.float32)
        check(codec._decode(ptr(np.ascontiguousarray(buf)), buf.size, codec.s_eff, self.total,
                            ptr(values)), "dithering")
        s_eff = np.float32(codec.s_eff)
        out = []
        for start, stop in self.bounds:
            chunk = values[start:stop]
            nz = np.flatnonzero(chunk)
            mag = np.abs(chunk[nz]).astype(np.float32)
            q = np.rint(mag.astype(np.float64) * float(s_eff) / float(scale)).astype(np.uint64)
            again = (q.astype(np.float32) * scale).astype(np.float32) / s_eff
            if not np.array_equal(again, mag):
                raise ValueError("dithering: a decoded value is not a level of its scale")
            gaps = np.diff(nz, prepend=-1).astype(np.uint64)
            out.append(dithering_stream(gaps, np.signbit(chunk[nz]), q, scale, word))
        return out


def _bit_length(v):
    """bit_length of each value (< 2^53, so exact in float64: frexp's exponent is it)."""
    return np.frexp(np.asarray(v, np.uint64).astype(np.float64))[1].astype(np.int64)


def _elias(v):
    """Elias-delta codes of v >= 1 (uint64): (code, length), as bitstream.h's elias_code."""
    n_bits = _bit_length(v)
    l_bits = _bit_length(n_bits.astype(np.uint64)) - 1
    code = ((n_bits - 1).astype(np.uint64) << (n_bits - 1).astype(np.uint64)) + v
    return code, 2 * l_bits + n_bits


def _pack(codes, lengths):
    """The codes (uint64, each at most 64 bits, MSB first) back to back: (big-endian uint64
    words, bit count). Each code lands in one word or spills into the next; the codes of a
    word are OR-ed together with one reduceat, as their word indices never decrease."""
    pos = np.cumsum(lengths) - lengths
    total = int(pos[-1] + lengths[-1]) if lengths.size else 0
    words = np.zeros(total // 64 + 2, np.uint64)
    if not lengths.size:
        return words, 0
    word, off = pos >> 6, pos & 63
    end = off + lengths
    inside = end <= 64
    shift = np.where(inside, 64 - end, end - 64).astype(np.uint64)
    first = np.where(inside, codes << shift, codes >> shift)
    starts = np.flatnonzero(np.diff(word, prepend=-1))
    words[word[starts]] |= np.bitwise_or.reduceat(first, starts)
    spill = ~inside
    words[word[spill] + 1] |= codes[spill] << (128 - end[spill]).astype(np.uint64)
    return words, total


def dithering_stream(gaps, negative, levels, scale, word):
    """A dithering payload (codecs.md) for entries (gap, sign, level), all >= 1 but the sign."""
    gcode, glen = _elias(gaps)
    qcode, qlen = _elias(levels)
    lengths = glen + 1 + qlen
    if lengths.size and lengths.max() > 64:
        raise ValueError("dithering: an entry of more than 64 bits (a gap past 2^21 with a level "
                         "past 2^21); use a smaller BYTEPS_PARTITION_BYTES for entiremodel")
    codes = (gcode << (qlen + 1).astype(np.uint64)) | \
        (negative.astype(np.uint64) << qlen.astype(np.uint64)) | qcode
    words64, bits = _pack(codes, lengths)
    wbits = word.itemsize * 8
    nwords = -(-bits // wbits)
    stream = words64.astype(">u8").view(np.uint8)[: nwords * word.itemsize]
    words = stream.view(word.newbyteorder(">")).astype(word.newbyteorder("<"))
    return np.concatenate([words.view(np.uint8), np.array([bits], word).view(np.uint8),
                           np.array([scale], np.float32).view(np.uint8)])


class EntireModelSlice(Forwarding, Codec):
    """A chunk's codec on a worker: its payload is the cut the binding left in PENDING for the
    step context's group and chunk; it decodes as the ordinary codec of the chunk."""

    def __init__(self, params, n, dtype, key):
        super().__init__(params, n, dtype)
        self.inner = build_chain(layerwise(params, ef=None, momentum=None, mu=None), n, dtype,
                                 key=key, role="server")

    def compress(self, x, ctx=None):
        ctx = ctx or {}
        slot = (int(ctx.get(GROUP_KEY, -1)), int(ctx.get(CHUNK_KEY, -1)))
        with _pending_lock:
            payload, n = PENDING.pop(slot, (None, None))
        if payload is None:
            raise ValueError("granularity 'entiremodel': no whole-model payload waits for this "
                             f"chunk (group, chunk) = {slot}; entire-model tensors are pushed by "
                             "the bindings (DistributedOptimizer, DistributedTrainer, "
                             "bps_gc.algorithms.entire_model.EntireModel), not by push_pull")
        if n != self.n:
            raise ValueError(f"granularity 'entiremodel': chunk {slot[1]} of {n} elements was cut "
                             f"into partitions of {self.n}; the binding sized chunks for another "
                             "BYTEPS_PARTITION_BYTES than the worker uses")
        return payload


def leave(group, payloads):
    """Make the chunk payloads of ``group``, (payload, chunk length) pairs, available to their
    EntireModelSlice codecs."""
    with _pending_lock:
        for c, entry in enumerate(payloads):
            PENDING[(group, c)] = entry


def discard(group):
    """Drop what a failed step left behind."""
    with _pending_lock:
        for slot in [s for s in PENDING if s[0] == group]:
            del PENDING[slot]


SLICE_CODECS["entiremodel"] = EntireModelSlice
