"""The exchange's codecs, one per named part (as torch's PowerSGDState, in named fields): a
call's parts (``Batch``), each part's codec kept under its id (``PartCodec``, held by
``PartCodecs``; docs/checkpoint.md), and what is kept for a batch index across calls
(``BatchState``).

Each part keeps its chain, reducer and step count when DDP regroups its buckets (after the
first step, or with another ``bucket_cap_mb`` after a restart), and its state is saved under its
name: the parameter's (``named_parameters``), else ``param.<i>`` in the order of the optimizer's
parameters (as torch's optimizer state names them), or the part's own name."""
import dataclasses
import functools
import zlib
from typing import Any, Optional

import numpy as np
import torch.distributed as dist

from ... import compress
from ...comm.placement import partition_owner
from ...compress.device.reducers import device_reduction
from ...compress.stateful import StateError, StateGroup, Stateful
from ..coded import CodedPart
from .tensors import built_or_refused, runs_on_device, wire_dtype

KEY_BASE = 1 << 40  # bucket keys apart from declared tensors' (index << 16 | partition)
NAME_KEY_BASE = 1 << 41  # named parts' keys, apart from both


def bucket_key(index, position):
    """The codec key (seed source) of the ``position``-th part of batch (DDP bucket) ``index``."""
    return KEY_BASE | index << 16 | position


def name_key(name):
    """The codec key of a part named ``name``: from the name alone, so it is the same on every
    rank and wherever the part stands in its batch."""
    return NAME_KEY_BASE | (zlib.crc32(name.encode()) & 0xFFFFFF) << 16


def key_owner(key, local_size):
    """Two levels: the local rank that keeps the chain of the part keyed ``key`` (where it was
    first seen, so the owner stays when DDP regroups the buckets, or after a restart), by
    ps/worker/host's rule."""
    return partition_owner(key >> 16 & 0xFFFFFF, key & 0xFFFF, local_size)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One call's parts: ``buffer`` (a flat tensor, written with the average) cut into parts of
    ``sizes``; ``ids``: what each part's codec is kept under (its parameter's id, its name, or
    (index, position)); ``names``: the parts' names (their codecs are keyed by them), or None
    (keyed by ``index`` and position, as a DDP bucket's); ``shapes``: the parts' shapes (PowerSGD
    views them as matrices); ``device_codecs``: the process's BPS_GC_DEVICE_CODECS now."""
    index: int  # the caller's batch index (DDP's bucket index): its state, messages and stamps
    buffer: Any
    sizes: list
    ids: list
    names: Optional[list] = None
    shapes: Optional[list] = None
    device_codecs: str = "auto"

    def key(self, position):
        """The seed key of a part first seen at ``position``."""
        return name_key(self.names[position]) if self.names is not None else bucket_key(self.index, position)


@dataclasses.dataclass
class BatchState:
    """What is kept for batch ``index`` across calls; made again when the batch's ``sizes``,
    ``device``, ``dtype`` or part ids change (DDP regroups after the first step), from the
    parts' own codecs."""
    sizes: list
    device: Any
    dtype: Any  # the buffer's torch dtype (its codecs' wire dtype follows it: tensors.py)
    codecs: list  # [PartCodec], one per part, in batch order
    on_device: bool  # device chains and reducers (BPS_GC_DEVICE_CODECS), else numpy ones
    ids: list

    @functools.cached_property
    def parts(self):
        """[coded.CodedPart], one per part, back to back in the buffer (``partitions``: what
        comm.phased reads)."""
        parts, start = [], 0
        for codec in self.codecs:
            parts.append(CodedPart(start, start + codec.n, codec.chain, codec.reducer))
            start += codec.n
        return parts

    @property
    def partitions(self):
        return self.parts

    @property
    def keys(self):
        return tuple(codec.key for codec in self.codecs)


class PartCodec(Stateful):
    """One part's worker chain (None where this rank reduces the part alone and sums its own
    values exactly: PartCodecs.sums_own_exactly) and reducer (None for a phased codec:
    phased.py); ``key`` seeds both (from where it was first seen), ``steps`` counts its
    reductions (the step context)."""

    state_attrs = ("key", "steps")

    def __init__(self, key, n, device, on_device, wire, chain, reducer):
        self.key, self.n, self.device, self.on_device, self.wire = key, n, device, on_device, wire
        self.chain, self.reducer, self.steps = chain, reducer, 0

    def state_children(self):
        return ((("worker/", self.chain),) if self.chain is not None else ()) + \
            ((("reducer/", self.reducer),) if self.reducer is not None else ())

    def fits(self, n, device, on_device, wire):
        return (self.n, self.device, self.on_device, self.wire) == (n, device, on_device, wire)


class PartCodecs:
    """Each part's PartCodec, keyed by its id, the state of each batch index, and checkpoints by
    name. Made from ``params`` (CompressionParams), ``reducer`` (the reducer's name),
    ``optimizer`` (without names, the parameters' source, or None), ``named_parameters``
    ([(name, parameter)] or None) and ``phased`` (thc's and PowerSGD's phases, phased.py: float32
    numpy chains without reducers)."""

    def __init__(self, params, reducer, optimizer, named_parameters, phased, seed_rank=None):
        self.params, self.reducer, self.optimizer, self.phased = params, reducer, optimizer, phased
        # the rank the chains' draws are seeded by (None: this process's torch.distributed rank);
        # an exchange on a sub-group whose ranks repeat across hosts passes the job's rank
        self.seed_rank = seed_rank
        self.named = None if named_parameters is None else list(named_parameters)
        self.codecs = {}  # part id -> PartCodec
        self.batches = {}  # batch index -> BatchState
        # None: each codec keeps its own scratch buffers; or a compress.Scratch shared by every
        # part's chain and reducer, numpy or device (Pipeline.share_scratch)
        self.scratch = None
        # None: every part is reduced here; or a predicate on a part's name (Pipeline.reduce_at):
        # a part it refuses gets no reducer (no server chain, no state of it) and is not reduced
        self.reduced_here = None
        # reducers other than ``reducer`` that a checkpoint's part may hold and keep (Pipeline.keep_saved_reducers)
        self.saved_reducers_kept = ()

    def reduces(self, name):
        """Whether this rank reduces the part named ``name`` (a phased codec: always)."""
        return self.phased or self.reduced_here is None or name is None or self.reduced_here(name)

    def sums_own_exactly(self, name, reducer=None):
        """Whether this rank's own payload of the part named ``name`` is its values as they are
        (coded.Exact), with no worker chain (no residual): under reduce_at, on the rank that
        reduces the part alone, when its reducer (``reducer``, else the exchange's) is the exact
        sum. Those values never leave the rank: a codec would only add its error to them."""
        return (not self.phased and self.reduced_here is not None and name is not None
                and self.reduced_here(name) and (reducer or self.reducer) == "lossless")

    def state_of(self, batch):
        """The BatchState of ``batch``, kept while its parts stay the same."""
        state, buffer = self.batches.get(batch.index), batch.buffer
        if (state is None or state.sizes != batch.sizes or (state.device, state.dtype) != (buffer.device, buffer.dtype)
                or state.ids != batch.ids):
            codecs, on_device = self.codecs_for(batch)
            state = self.batches[batch.index] = BatchState(batch.sizes, buffer.device, buffer.dtype, codecs,
                                                           on_device, batch.ids)
        return state

    def _codec_kind(self, tensor, device_codecs):
        """(on device, wire dtype) of a part's codec: phased codecs run float32 numpy chains;
        others follow the buffer (tensors.py, BPS_GC_DEVICE_CODECS)."""
        if self.phased:
            return False, np.dtype(np.float32)
        return runs_on_device(tensor, device_codecs), wire_dtype(tensor, self.params.fp16)

    def _make_codec(self, key, n, tensor, on_device, wire, shape=None, reduced=True, reducer=None, exact=False):
        """A fresh PartCodec of ``n`` elements where ``tensor`` lives (its draws this process's
        own: build_chain's ``rank`` is ``seed_rank`` or its torch.distributed rank); ``shape``: the
        part's, for a codec that views it as a matrix (PowerSGD); ``reduced``: False for a part
        another rank reduces (no reducer); ``reducer``: its name, if not the exchange's;
        ``exact``: no worker chain (sums_own_exactly)."""
        reducer = reducer or self.reducer
        rank = self.seed_rank if self.seed_rank is not None else dist.get_rank() if dist.is_initialized() else 0
        if self.phased:  # its reducer runs as the phases of phased.py
            chain = compress.build_chain(self.params, n, wire, key=key, role="worker", rank=rank, shape=shape)
            compress.use_scratch(chain, self.scratch)
            return PartCodec(key, n, tensor.device, on_device, wire, chain, None)
        device = {"device": tensor.device} if on_device else {}
        chain = None if exact else compress.build_chain(self.params, n, wire, key=key, role="worker", rank=rank,
                                                         **device)
        reducer = (None if not reduced else
                   device_reduction(reducer, self.params, n, wire, key, tensor.device) if on_device else
                   compress.make_reducer(reducer, self.params, n, wire, key))
        for codec in (chain, reducer):  # device codecs take tensors from it (device/base.py shared_tensor)
            compress.use_scratch(codec, self.scratch)
        return PartCodec(key, n, tensor.device, on_device, wire, chain, reducer)

    def codecs_for(self, batch):
        """([PartCodec] of ``batch``'s parts, on device): each one's own when it was seen before
        with this size, device and wire dtype, else a fresh one seeded by ``batch.key``."""
        buffer = batch.buffer
        on_device, wire = self._codec_kind(buffer, batch.device_codecs)

        def build():
            codecs = []
            for position, (part, n) in enumerate(zip(batch.ids, batch.sizes)):
                codec = self.codecs.get(part)
                if codec is None or not codec.fits(n, buffer.device, on_device, wire):
                    shape = batch.shapes[position] if batch.shapes else None
                    name = batch.names[position] if batch.names else None
                    codec = self.codecs[part] = self._make_codec(batch.key(position), n, buffer, on_device, wire,
                                                                 shape, self.reduces(name),
                                                                 exact=self.sums_own_exactly(name))
                codecs.append(codec)
            return codecs
        return built_or_refused(build, self.params, batch.index, buffer), on_device

    def refusal(self, name, tensor, device_codecs):
        """Why this codec cannot carry a part named ``name`` of ``tensor``'s dtype (its
        TypeError's text), or None: a throwaway codec is built, as the first call would build it,
        so a caller that knows its dtypes early (FSDP's reduce dtype) refuses before any step."""
        try:
            self._make_codec(name_key(name), tensor.numel(), tensor, *self._codec_kind(tensor, device_codecs),
                             tuple(tensor.shape))
        except TypeError as e:
            return str(e)
        return None

    @staticmethod
    def next_step(codecs):
        """The step context's ``step`` of a batch of ``codecs``: how many times they were reduced."""
        step = max(codec.steps for codec in codecs)
        for codec in codecs:
            codec.steps = step + 1
        return step

    # ------------------------------------------------------------------ checkpoints

    def _named(self):
        """{name: parameter} of the parts' parameters."""
        if self.named is not None:
            return dict(self.named)
        if self.optimizer is None:
            raise StateError("comm_hook: its state is keyed by parameter name; pass "
                             "named_parameters=model.named_parameters() (or optimizer=) to comm_hook")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {f"param.{i}": p for i, p in enumerate(params)}

    def codec_state(self):
        """A Stateful of every part's codec, by parameter name (or the part's own)."""
        by_name = {g: g for g in self.codecs if isinstance(g, str)}  # named parts without parameters
        names = {**({id(p): name for name, p in self._named().items()} if len(by_name) < len(self.codecs) else {}),
                 **by_name}
        unnamed = [g for g in self.codecs if g not in names]
        if unnamed:
            raise StateError(f"comm_hook: {len(unnamed)} gradient(s) of its buckets are not among the "
                             "parameters it was given (named_parameters= or optimizer=)")
        return StateGroup({names[g]: codec for g, codec in self.codecs.items()})

    def codec_state_to_load(self, sd, device_codecs):
        """(a Stateful of fresh codecs for the parameters ``sd`` holds, made with their saved
        keys, where BPS_GC_DEVICE_CODECS ``device_codecs`` puts them; a function that installs them once loaded, forgetting the batches, which are made
        again from them). Parameters this model lacks are refused, named."""
        named = self._named()
        saved = sorted({key.split("/", 1)[0].removeprefix("identity.") for key in sd})
        unknown = [name for name in saved if name not in named]
        if unknown:
            raise StateError(f"comm_hook: the state holds parameters this model does not have: "
                             f"{', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}")
        fresh = {}
        for name in saved:
            p, key = named[name], sd.get(f"{name}/key")
            if isinstance(key, bool) or not isinstance(key, int) and not hasattr(key, "__index__"):
                raise StateError(f"comm_hook: the state of {name!r} has no integer key")
            # a state saved with the part's reducer (before reduce_at refused it) loads as saved
            reduced = self.reduces(name) or any(k.startswith(f"{name}/reducer/") for k in sd)
            saved_reducer = sd.get(f"identity.{name}/reducer/reducer")
            reducer = saved_reducer if saved_reducer in self.saved_reducers_kept else None
            # a part whose own values were compressed when it was saved (before 2026-12-01) loads
            # with its worker chain, and resumes as it ran
            exact = self.sums_own_exactly(name, reducer) and f"identity.{name}/worker/codec.name" not in sd
            fresh[name] = self._make_codec(int(key), p.numel(), p, *self._codec_kind(p, device_codecs),
                                           tuple(p.shape), reduced, reducer, exact)

        def install():
            self.codecs.update((id(named[name]), codec) for name, codec in fresh.items())
            self.batches.clear()
        return StateGroup(fresh), install
