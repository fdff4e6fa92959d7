"""``granularity: entiremodel`` for the bindings (algorithms.md section 3): a step's gradients
are reduced as one vector, compressed once.

``EntireModel`` concatenates the arrays, runs the codec chain once over the whole vector
(``compress.entire_model.WholeVectorCodec``: one top-k, threshold, norm or max; momentum and error
feedback over the whole vector too), cuts the payload at chunk boundaries and push_pulls each
chunk as its own declared tensor ``<name>.<c>``. A chunk fits in one partition
(``BYTEPS_PARTITION_BYTES``, rounded down to 64 elements) and the chunks are about equally
long, so the placement spreads them over the servers as it spreads layers. The servers reduce
with ``lossless`` unless told otherwise (``recompress`` would re-select per chunk); the pulled
sum is then exactly the sum of every worker's whole-model decoding.

A chunk the runtime leaves uncompressed (under ``BYTEPS_MIN_COMPRESS_BYTES``) carries its part
of the whole-model decoding as dense values, so the result stays the same; in a single
undistributed process nothing is compressed, as for layer-wise tensors.
"""
import itertools
import os

import numpy as np

from .. import core
from ..compress import CompressionParams, choose_reducer
from ..compress.entire_model import (ALIGN, CHUNK_KEY, GROUP_KEY, WholeVectorCodec, check_splittable,
                                    discard, leave)
from ..config import EnvReader

_groups = itertools.count()


def is_entire_model(compression_params):
    return (compression_params or {}).get("granularity") == "entiremodel"


def one_dtype(dtypes):
    """The one dtype of the gradients reduced as one vector (None for none); a ValueError naming
    them if they differ."""
    dtypes = set(dtypes)
    if len(dtypes) > 1:
        raise ValueError("granularity 'entiremodel' needs one dtype for all compressed "
                         f"gradients, got {sorted(str(d) for d in dtypes)}")
    return dtypes.pop() if dtypes else None


def chunk_bounds(total, wire_itemsize, partition_bytes):
    """(start, stop) of each chunk: starts at multiples of ALIGN, each within one partition,
    lengths within ALIGN of each other."""
    per = partition_bytes // wire_itemsize // ALIGN * ALIGN
    if per == 0:
        raise ValueError(f"granularity 'entiremodel' needs BYTEPS_PARTITION_BYTES of at least "
                         f"{ALIGN} elements ({ALIGN * wire_itemsize} bytes), got {partition_bytes}")
    count = max(1, -(-total // per))
    size = max(ALIGN, -(-(-(-total // count)) // ALIGN) * ALIGN)  # ceil(ceil(total/count)/ALIGN)
    return [(c * size, min(total, (c + 1) * size)) for c in range(count)]


class EntireModel:
    """Reduces lists of arrays of the given ``shapes`` (one dtype) as one compressed vector.
    Declares ``<name>.<c>`` for each chunk, in the same order on every worker."""

    def __init__(self, name, shapes, dtype, compression_params, reducer=None):
        params = CompressionParams.from_dict(dict(compression_params, granularity="entiremodel"))
        check_splittable(params)
        if params.compressor == "powersgd":
            raise ValueError("granularity 'entiremodel' does not apply to powersgd")
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.cumsum([0] + self.sizes)
        self.total = int(self.offsets[-1])
        self.dtype = np.dtype(dtype)
        self.wire_dtype = np.dtype(np.float16) if params.fp16 else self.dtype
        if reducer is None:  # the codec's default, but never a per-chunk recompression
            reducer = choose_reducer(params)
            reducer = "lossless" if reducer == "recompress" else reducer
        partition_bytes = EnvReader(os.environ).integer("BYTEPS_PARTITION_BYTES", 4_096_000, low=8)
        self.bounds = chunk_bounds(self.total, self.wire_dtype.itemsize, partition_bytes)
        self.names = [f"{name}.{c}" for c in range(len(self.bounds))]
        self.declarations = [core.declare(n, shape=(stop - start,), dtype=self.dtype, reducer=reducer,
                                          **params.to_dict())
                             for n, (start, stop) in zip(self.names, self.bounds)]
        self.compressed = any(d.compressed for d in self.declarations)
        self.group = next(_groups)
        key = (1 << 63) | self.group  # the whole vector's seed when none is given
        self.codec = WholeVectorCodec(params, self.total, self.wire_dtype, self.bounds, key) \
            if self.compressed else None
        self.flat = np.empty(self.total, self.dtype)

    def reduce(self, arrays, ctx, average=True):
        """Sum (or average) each array over all workers, in place, as one vector."""
        handles = None
        try:
            handles = self.post(arrays, ctx, average)
        finally:
            if handles is None:
                discard(self.group)
        return self.finish(handles, arrays)

    def post(self, arrays, ctx, average=True):
        """``reduce``'s first half: compress the vector and push_pull each chunk; the handles,
        for ``finish`` (a caller that posts other tensors of the step before waiting)."""
        if len(arrays) != len(self.sizes):
            raise ValueError(f"entiremodel: got {len(arrays)} arrays, declared {len(self.sizes)}")
        for array, start, size in zip(arrays, self.offsets, self.sizes):
            if np.size(array) != size:
                raise ValueError(f"entiremodel: an array of {np.size(array)} elements where "
                                 f"{size} were declared")
            self.flat[start:start + size] = np.asarray(array).reshape(-1)
        ctx = dict(ctx or {})
        if self.compressed:
            self._leave_payloads(ctx)
        return [core.push_pull(self.flat[start:stop], name, average=average,
                               ctx={**ctx, GROUP_KEY: self.group, CHUNK_KEY: c})
                for c, (name, (start, stop)) in enumerate(zip(self.names, self.bounds))]

    def finish(self, handles, arrays):
        """``reduce``'s second half: wait for ``post``'s handles, write the result into ``arrays``."""
        try:
            for handle in handles:
                handle.wait()
        finally:
            discard(self.group)  # nothing is left after a good step; a failed one leaves junk
        for array, start, size in zip(arrays, self.offsets, self.sizes):
            array.reshape(-1)[...] = self.flat[start:start + size]
        return arrays

    def _leave_payloads(self, ctx):
        wire = self.flat.astype(self.wire_dtype) if self.wire_dtype != self.dtype else self.flat
        payload = self.codec.chain.compress(wire, ctx)
        payloads = self.codec.split(payload)
        if not all(d.compressed for d in self.declarations):
            decoded = self.codec.decoder.decompress(payload)  # dense chunks carry their part of it
            for (start, stop), d in zip(self.bounds, self.declarations):
                if not d.compressed:
                    self.flat[start:stop] = decoded[start:stop]
        leave(self.group, [(p, stop - start) for p, (start, stop) in zip(payloads, self.bounds)])
