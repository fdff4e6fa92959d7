"""Server reducers: how the pushes of one compressed partition become the reply every worker pulls.

A reducer is registered by name (``register_reducer``, like codecs) and made per partition as
``REDUCERS[name](params, n, dtype, codecs)``, where ``codecs(role)`` builds this partition's codec
chain for ``role`` "server" (with server error feedback), or "decode" (the bare compressor, enough
to decode any payload). The same class runs on both sides, numpy only:

* server: ``reduce(payloads, compressed, ctx)`` -> the uint8 reply (payloads in worker-rank
  order; ``compressed`` False means they are raw elements of ``dtype``);
* worker: ``decode(reply, out, ctx)`` writes the reduced partition into ``out``.

``summed`` says whether the result is a sum (a push_pull with ``average`` divides it by the
number of workers) or already a per-element vote (majority). Reply formats: docs/codecs.md.
Uncompressed keys do not use reducers: the server sums them in place.
"""
import dataclasses

import numpy as np

from .chain import build_chain
from .context import step_context
from .registry import COMPRESSORS, load_plugins
from .scratch import use_scratch
from .stateful import Stateful

REDUCERS = {}
DEFAULT_DENSE = "sum"  # what an uncompressed key does; not a registered reducer


def register_reducer(name):
    """Class decorator: ``cls(params, n, dtype, codecs)`` becomes reducer ``name``."""
    def wrap(cls):
        if not isinstance(name, str) or not name:
            raise ValueError(f"reducer name must be a non-empty string, got {name!r}")
        if REDUCERS.get(name, cls) is not cls:
            raise ValueError(f"reducer {name!r} is already registered by {REDUCERS[name].__module__}")
        cls.name = name
        REDUCERS[name] = cls
        return cls
    return wrap


def choose_reducer(params, reducer=None):
    """The reducer name a tensor with these CompressionParams uses: ``reducer`` when its codec
    supports it, the codec's default when None. A ValueError names both when they do not fit."""
    if reducer is not None and not isinstance(reducer, str):
        raise TypeError(f"reducer must be a name (str), got {type(reducer).__name__}")
    if not params.compressed:
        if reducer not in (None, DEFAULT_DENSE, "lossless"):
            raise ValueError(f"reducer {reducer!r} needs a compressor: uncompressed tensors are "
                             f"summed exactly (reducer 'sum')")
        return DEFAULT_DENSE
    load_plugins()
    supported = tuple(getattr(COMPRESSORS[params.compressor], "reducers", ()))
    if reducer is None:
        if not supported:
            raise ValueError(f"compressor {params.compressor!r} lists no reducers")
        return supported[0]
    if reducer not in REDUCERS:
        raise ValueError(f"unknown reducer {reducer!r}; registered: {', '.join(sorted(REDUCERS))}")
    # a reducer that decodes every push (decodes_pushes) takes any codec whose payloads decode
    # and add, which those supporting "lossless" say
    if reducer not in supported and not (getattr(REDUCERS[reducer], "decodes_pushes", False)
                                         and "lossless" in supported):
        raise ValueError(f"compressor {params.compressor!r} does not support reducer {reducer!r}; "
                         f"it supports: {', '.join(supported)}")
    return reducer


def chain_factory(params, n, dtype, key):
    """The ``codecs(role)`` argument of a reducer for partition ``key``."""

    def codecs(role):
        if role == "decode":  # a payload decodes without the decorators' state
            bare = dataclasses.replace(params, ef=None, momentum=None, mu=None)
            return build_chain(bare, n, dtype, key=key, role="server")
        return build_chain(params, n, dtype, key=key, role=role)
    return codecs


def make_reducer(name, params, n, dtype, key=0):
    return REDUCERS[name](params, n, dtype, chain_factory(params, n, dtype, key))


class Reducer(Stateful):
    """Base of the reducers; its state (``state_dict``) is the server chain's where it keeps
    one (recompress), else only its identity."""

    summed = True
    # sum phases per reduce: 1 is one push and one reply; more (PowerSGD's P then Q) means the
    # communicator drives the phases itself as dense sums (bps_gc/comm/phased.py)
    phases = 1

    def __init__(self, params, n, dtype, codecs):
        self.params, self.n, self.dtype = params, int(n), np.dtype(dtype)
        self.codecs = codecs
        self._decoder = None
        self.scratch = None  # or a scratch.Scratch shared with other partitions' reducers

    def state_identity(self):
        return {"reducer": self.name, "params": self.params.to_json().decode(), "n": self.n,
                "dtype": str(self.dtype)}

    @property
    def decoder(self):
        if self._decoder is None:
            self._decoder = self.codecs("decode")
            use_scratch(self._decoder, self.scratch)
        return self._decoder

    def total(self, payloads, compressed, acc=None, decoder=None):
        """Sum of the decoded pushes, in rank order, added to zeros."""
        acc = np.zeros(self.n, self.dtype) if acc is None else acc
        decoder = decoder or self.decoder
        for payload in payloads:
            if compressed:
                decoder.decompress_add(payload, acc)
            else:
                acc += np.frombuffer(payload, self.dtype, self.n)
        return acc

    def reduce(self, payloads, compressed, ctx=None):
        raise NotImplementedError

    def decode(self, reply, out, ctx=None):
        raise NotImplementedError


class PhasedSums(Reducer):
    """Base of the reductions whose phases are plain sums that the communicator drives
    (comm/phased.py): no one-round reduce or decode exists, so both say so by name."""

    phases = 2
    phase_sums = "phases are sums"  # what a subclass's phases are, for the refusals

    def _no_round(self, what):
        raise ValueError(f"{self.name}: its {self.phase_sums} that the communicator drives "
                         f"(phases = {self.phases}); there {what}")

    def reduce(self, payloads, compressed, ctx=None):
        self._no_round("are no payloads to reduce in one round")

    def decode(self, reply, out, ctx=None):
        self._no_round("is no one-round reply to decode")


@register_reducer("recompress")
class Recompress(Reducer):
    """BytePS: decode, sum in rank order, re-encode with the server's chain (server error
    feedback included); the reply is a payload of the tensor's codec."""

    def __init__(self, params, n, dtype, codecs):
        super().__init__(params, n, dtype, codecs)
        self._chain = None
        self._acc = None  # the pushes' sum, kept for the next step (without a shared scratch)

    @property
    def chain(self):
        """The server's codec chain (server error feedback included), made on first use."""
        if self._chain is None:
            self._chain = self.codecs("server")
            use_scratch(self._chain, self.scratch)
        return self._chain

    def state_children(self):
        return (("chain.", self.chain),)

    def reduce(self, payloads, compressed, ctx=None):
        if self.scratch is not None:
            acc = self.scratch.take("sum", self.n, self.dtype)
        else:
            if self._acc is None:
                self._acc = np.empty(self.n, self.dtype)
            acc = self._acc
        acc.fill(0)
        acc = self.total(payloads, compressed, acc, self.chain)
        return self.chain.compress(acc, step_context(ctx))

    def decode(self, reply, out, ctx=None):
        return self.decoder.decompress(reply, out)


@register_reducer("lossless")
class Lossless(Reducer):
    """Decode and sum; the reply is the exact sum, as packed (uint32 index, value) records of
    its nonzero elements while that is shorter than the dense array, else the dense array (the
    reply's length tells which)."""

    def __init__(self, params, n, dtype, codecs):
        super().__init__(params, n, dtype, codecs)
        self.record = np.dtype([("i", "<u4"), ("v", self.dtype.newbyteorder("<"))])
        self.dense_bytes = self.n * self.dtype.itemsize

    def reduce(self, payloads, compressed, ctx=None):
        acc = self.total(payloads, compressed)
        nonzero = np.flatnonzero(acc)
        if nonzero.size * self.record.itemsize >= self.dense_bytes:
            return acc.view(np.uint8)
        rec = np.empty(nonzero.size, self.record)
        rec["i"], rec["v"] = nonzero, acc[nonzero]
        return rec.view(np.uint8)

    def decode(self, reply, out, ctx=None):
        buf = np.frombuffer(reply, np.uint8) if not isinstance(reply, np.ndarray) else reply.reshape(-1)
        out = out.reshape(-1)
        if buf.size == self.dense_bytes:
            out[:] = buf.view(self.dtype)
            return out
        if buf.size > self.dense_bytes or buf.size % self.record.itemsize:
            raise ValueError(f"lossless reply of {buf.size} bytes is neither {self.dense_bytes} "
                             f"dense bytes nor whole {self.record.itemsize}-byte records")
        rec = np.frombuffer(np.ascontiguousarray(buf), self.record)
        if rec.size and int(rec["i"].max()) >= self.n:
            raise ValueError("lossless reply: index out of range")
        out[:] = 0
        out[rec["i"]] = rec["v"]
        return out


@register_reducer("majority")
class Majority(Reducer):
    """signSGD's majority vote: the sign of the sum of the decoded pushes' signs, +1 on a tie.
    The reply is one bit per element, MSB first, 1 = negative (onebit's order), then one byte
    that is 1 when a push held a non-finite value; it decodes to +-1, or NaN everywhere after a
    non-finite push (a vote has no bit for NaN, and AMP's loss scaler must see it). It is not
    averaged (``summed`` is False)."""

    summed = False

    def __init__(self, params, n, dtype, codecs):
        super().__init__(params, n, dtype, codecs)
        self._scratch = np.empty(self.n, self.dtype)
        self._votes = np.empty(self.n, np.int32)

    def reduce(self, payloads, compressed, ctx=None):
        votes = self._votes
        votes.fill(0)
        finite = True
        for payload in payloads:
            if compressed:
                x = self.decoder.decompress(payload, self._scratch)
            else:
                x = np.frombuffer(payload, self.dtype, self.n)
            votes += x > 0
            votes -= x < 0
            finite = finite and bool(np.isfinite(x).all())
        return np.append(np.packbits(votes < 0), np.uint8(not finite))

    def decode(self, reply, out, ctx=None):
        buf = np.frombuffer(reply, np.uint8) if not isinstance(reply, np.ndarray) else reply.reshape(-1)
        size = -(-self.n // 8) + 1
        if buf.size != size or buf[-1] > 1:
            raise ValueError(f"majority reply of {buf.size} bytes, expected {size} for {self.n} "
                             "elements (bits, then a 0/1 non-finite byte)")
        out = out.reshape(-1)
        if buf[-1]:
            out[:] = np.nan
            return out
        negative = np.unpackbits(buf[:-1], count=self.n)
        np.subtract(1, 2 * negative.astype(self.dtype), out=out)
        return out
