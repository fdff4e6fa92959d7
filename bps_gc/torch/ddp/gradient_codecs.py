"""The DDP hook's state, in named fields (as torch's PowerSGDState): its codec per gradient,
keyed by parameter (GradientCodec, held by the hook's GradientCodecs part; docs/checkpoint.md), what it keeps for a bucket index across
steps (BucketState) and what one call hands its three threads (BucketJob).

Each gradient keeps its chain, reducer and step count when DDP regroups its buckets (after the
first step, or with another ``bucket_cap_mb`` after a restart), and its state is saved under
the parameter's name. Names come from ``comm_hook(..., named_parameters=)``, else from the
order of ``optimizer``'s parameters (``param.<i>``, as torch's optimizer state names them)."""
import dataclasses
import functools
import zlib
from typing import Any

import numpy as np
import torch.distributed as dist

from ... import compress
from ...collective.coded import CodedPart
from ...comm.placement import partition_owner
from ...compress.device.reducers import device_reduction
from ...compress.stateful import StateError, StateGroup, Stateful
from ..device import chain_for, uses_device_chain
from .dtypes import built_or_refused, wire_dtype


KEY_BASE = 1 << 40  # bucket keys apart from declared tensors' (index << 16 | partition)
NAME_KEY_BASE = 1 << 41  # named parts' keys, apart from both


def bucket_key(index, position):
    """The codec key (seed source) of the ``position``-th gradient of DDP bucket ``index``."""
    return KEY_BASE | index << 16 | position


def name_key(name):
    """The codec key of a part named ``name`` (torch/exchange.py): from the name alone, so it is
    the same on every rank and wherever the part stands in its batch."""
    return NAME_KEY_BASE | (zlib.crc32(name.encode()) & 0xFFFFFF) << 16


def key_maker(bucket, index):
    """``key_of(position)`` for ``bucket``'s gradients: by name where the bucket names its parts,
    else by the DDP bucket index and position where each was first seen."""
    names = bucket.names() if hasattr(bucket, "names") else None
    if names is not None:
        return lambda position: name_key(names[position])
    return lambda position: bucket_key(index, position)


def key_owner(key, local_size):
    """Two levels: the local rank that keeps the chain of the gradient keyed ``key`` (where it
    was first seen, so the owner stays when DDP regroups the buckets, or after a restart), by
    ps/worker/host's rule."""
    return partition_owner(key >> 16 & 0xFFFFFF, key & 0xFFFF, local_size)


@dataclasses.dataclass
class BucketState:
    """What the hook keeps for DDP bucket ``index`` across steps; made again when the bucket's
    ``sizes``, ``device``, ``dtype`` or gradients change (DDP regroups after the first step),
    from the gradients' own codecs."""
    sizes: list  # the numel of each gradient of the bucket
    device: Any  # the bucket's torch.device
    dtype: Any  # the bucket's torch dtype (its codecs' wire dtype follows it: dtypes.py)
    codecs: list  # [GradientCodec], one per gradient, in bucket order
    on_device: bool  # device chains and reducers (BPS_GC_DEVICE_CODECS), else numpy ones
    gradients: list  # the ids its gradients' codecs are kept under (GradientCodecs.gradient_ids)

    @functools.cached_property
    def parts(self):
        """[coded.CodedPart], one per gradient, back to back in the bucket."""
        return coded_parts(self.codecs)


@dataclasses.dataclass(frozen=True)
class BucketJob:
    """One call's bucket, as the compressing, exchanging and reducing threads take it."""
    group: Any  # the process group its collectives run on (the hook's own, or DDP's with two levels)
    index: int  # DDP's bucket index
    buffer: Any  # the bucket's flat gradient tensor, written with the average
    parts: list  # BucketState.parts
    ctx: dict  # the step context (lr, step)
    on_device: bool  # BucketState.on_device
    levels: Any  # the HostLevels it reduces through, or None (flat)
    keys: tuple = ()  # each gradient's seed key (where it was first seen): its two-level owner


def coded_parts(codecs):
    """[coded.CodedPart] of gradients' ``codecs`` (GradientCodec) laid back to back."""
    parts, start = [], 0
    for codec in codecs:
        parts.append(CodedPart(start, start + codec.n, codec.chain, codec.reducer))
        start += codec.n
    return parts


class GradientCodec(Stateful):
    """One gradient's worker chain and reducer (None in a phased bucket: phased_buckets.py);
    ``key`` seeds both (the bucket index and position where it was first seen), ``steps``
    counts its reductions (the step context)."""

    state_attrs = ("key", "steps")

    def __init__(self, key, n, device, on_device, wire, chain, reducer):
        self.key, self.n, self.device, self.on_device, self.wire = key, n, device, on_device, wire
        self.chain, self.reducer, self.steps = chain, reducer, 0

    def state_children(self):
        return (("worker/", self.chain),) + ((("reducer/", self.reducer),) if self.reducer is not None else ())

    def fits(self, n, device, on_device, wire):
        return (self.n, self.device, self.on_device, self.wire) == (n, device, on_device, wire)


class GradientCodecs:
    """CompressionHook's part that keeps each gradient's GradientCodec, keyed by its parameter
    (or its bucket index and position), and saves and loads them by parameter name.

    Made from the hook's ``params`` (CompressionParams), ``reducer`` (the reducer's name),
    ``optimizer`` (the learning rate's and, without names, the parameters' source, or None),
    ``named_parameters`` ([(name, parameter)] or None) and ``phased`` (thc's phased buckets,
    phased_buckets.py: float32 numpy chains without reducers). Its interface:

    * ``gradient_ids(bucket, index, count)``: the ids a bucket's gradients keep codecs under;
    * ``codecs_for(index, gradients, sizes, buffer, key_of)``: ([GradientCodec], on device);
    * ``next_step(codecs)``: the step context's ``step`` of a bucket, counted;
    * ``codec_state()`` / ``codec_state_to_load(sd)``: checkpoints (bps_gc/torch/checkpoint.py,
      through the hook's own methods of the same names, which also forget its buckets).
    """

    def __init__(self, params, reducer, optimizer, named_parameters, phased):
        self.params, self.reducer, self.optimizer, self.phased = params, reducer, optimizer, phased
        self.named = None if named_parameters is None else list(named_parameters)
        self.gradients = {}  # id(parameter) or (bucket index, position) -> GradientCodec

    def gradient_ids(self, bucket, index, count):
        """The ids the gradients of ``bucket`` keep their codecs under: their parameters (DDP's
        buckets, named ones given their parameters), their names (named buckets), or their
        bucket index and position (a bucket with neither)."""
        parameters = bucket.parameters() if hasattr(bucket, "parameters") else None
        if parameters is not None:
            return [id(p) for p in parameters]
        names = bucket.names() if hasattr(bucket, "names") else None
        if names is not None:
            return list(names)
        return [(index, position) for position in range(count)]

    def _codec_kind(self, tensor):
        """(on device, wire dtype) of a gradient's codec: phased buckets run float32 numpy
        chains (phased_buckets.py); others follow the bucket (dtypes.py, BPS_GC_DEVICE_CODECS)."""
        if self.phased:
            return False, np.dtype(np.float32)
        return uses_device_chain(tensor), wire_dtype(tensor, self.params.fp16)

    def _make_codec(self, key, n, tensor, on_device, wire, shape=None):
        """A fresh GradientCodec of ``n`` elements where ``tensor`` lives (its draws this
        process's own: build_chain's ``rank`` is its torch.distributed rank); ``shape``: the
        gradient's, for a codec that views it as a matrix (PowerSGD)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.phased:  # its reducer runs as the phases of phased_buckets.py
            chain = compress.build_chain(self.params, n, wire, key=key, role="worker", rank=rank, shape=shape)
            return GradientCodec(key, n, tensor.device, on_device, wire, chain, None)
        if on_device:
            chain = chain_for(self.params, n, wire, key, "worker", tensor, rank=rank)
            reducer = device_reduction(self.reducer, self.params, n, wire, key, tensor.device)
        else:
            chain = compress.build_chain(self.params, n, wire, key=key, role="worker", rank=rank)
            reducer = compress.make_reducer(self.reducer, self.params, n, wire, key)
        return GradientCodec(key, n, tensor.device, on_device, wire, chain, reducer)

    def codecs_for(self, index, gradients, sizes, buffer, key_of, shapes=None):
        """The codecs of a bucket's gradients: each one's own when it was seen before with this
        size, device and wire dtype, else a fresh one seeded by ``key_of(position)`` (``shapes``:
        the gradients', where the codec views them as matrices)."""
        on_device, wire = self._codec_kind(buffer)

        def build():
            codecs = []
            for position, (gradient, n) in enumerate(zip(gradients, sizes)):
                codec = self.gradients.get(gradient)
                if codec is None or not codec.fits(n, buffer.device, on_device, wire):
                    codec = self.gradients[gradient] = self._make_codec(key_of(position), n, buffer, on_device, wire,
                                                                        shapes and shapes[position])
                codecs.append(codec)
            return codecs
        return built_or_refused(build, self.params, index, buffer), on_device

    def next_step(self, codecs):
        """The step context's ``step`` of a bucket of ``codecs``: how many times they were reduced."""
        step = max(codec.steps for codec in codecs)
        for codec in codecs:
            codec.steps = step + 1
        return step

    # ------------------------------------------------------------------ checkpoints

    def _named(self):
        """{name: parameter} of the hook's parameters."""
        if self.named is not None:
            return dict(self.named)
        if self.optimizer is None:
            raise StateError("comm_hook: its state is keyed by parameter name; pass "
                             "named_parameters=model.named_parameters() (or optimizer=) to comm_hook")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {f"param.{i}": p for i, p in enumerate(params)}

    def codec_state(self):
        """A Stateful of every gradient's codec, by parameter name."""
        by_name = {g: g for g in self.gradients if isinstance(g, str)}  # named parts without parameters
        names = {**({id(p): name for name, p in self._named().items()} if len(by_name) < len(self.gradients) else {}),
                 **by_name}
        unnamed = [g for g in self.gradients if g not in names]
        if unnamed:
            raise StateError(f"comm_hook: {len(unnamed)} gradient(s) of its buckets are not among the "
                             "parameters it was given (named_parameters= or optimizer=)")
        return StateGroup({names[g]: codec for g, codec in self.gradients.items()})

    def codec_state_to_load(self, sd):
        """(a Stateful of fresh codecs for the parameters ``sd`` holds, made with their saved
        keys; a function that installs them once loaded). Parameters this model lacks are
        refused, named."""
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
            fresh[name] = self._make_codec(int(key), p.numel(), p, *self._codec_kind(p), tuple(p.shape))

        def install():
            self.gradients.update((id(named[name]), codec) for name, codec in fresh.items())
        return StateGroup(fresh), install
