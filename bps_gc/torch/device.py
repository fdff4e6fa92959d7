"""Which codec chains bps_gc.torch runs for a tensor, and push_pull through device chains.

BPS_GC_DEVICE_CODECS (config.py; docs/device_codecs.md): ``auto`` runs the device chains
(``bps_gc.compress.build_chain(..., device=...)``, torch operations where the tensor lives) for
tensors off the CPU and the numpy chains for CPU tensors; ``torch`` runs the device chains for
every tensor, CPU ones too; ``numpy`` copies every tensor to the host for the numpy chains.

A push_pull through device chains (``DevicePushPull``) compresses each partition of the
communicator (``Communicator.partitions``: same keys, so the same seeds as the numpy chains) on
the device, then:

* parameter server: only the payloads are copied to the host and pushed
  (``Worker.push_payloads``); each server's reply is copied to the device and decoded there;
* torch.distributed: the payloads are all_gathered as device tensors (``Collective.push_payloads``)
  and every rank runs the server's reduction on the device (``device_reduction``).

Tensors the communicator sends dense (no compressor, below BYTEPS_MIN_COMPRESS_BYTES) are summed
on the device by torch.distributed (``Collective.reduce_tensor``) and staged through the host for
the parameter server, whose servers sum them; reducers summed in phases (PowerSGD) and the
entire-model granularity keep the host path.
"""
import weakref

import numpy as np
import torch

import bps_gc.core as core

from .. import compress
from ..collective.exchange.driver import Driver
from ..collective.exchange.jobs import ResultSegment
from ..collective.exchange.tensors import runs_on_device
from ..compress.device import torch_dtype
from ..compress.device.reducers import device_reduction

_partitions = weakref.WeakKeyDictionary()  # communicator -> {(name, device): [DevicePartition]}


def uses_device_chain(tensor):
    """Whether ``tensor``'s codecs run as torch operations on its device."""
    return runs_on_device(tensor, core.device_codecs())


def chain_for(params, n, dtype, key, role, tensor, shape=None, rank=0):
    """The codec chain of one partition of ``tensor``: a device chain on its device when
    ``uses_device_chain(tensor)``, else the numpy chain (``dtype``: a numpy dtype; ``rank``:
    the worker's, for build_chain)."""
    device = {"device": tensor.device} if uses_device_chain(tensor) else {}
    return compress.build_chain(params, n, dtype, key=key, role=role, shape=shape, rank=rank, **device)


# ---------------------------------------------------------------- push_pull


class DevicePartition:
    """A partition's device chain (``codec``) and reduction (``reducer``): a collective.coded part."""

    def __init__(self, declaration, key, start, stop, device):
        self.key, self.start, self.stop = key, start, stop
        n, dtype = stop - start, declaration.wire_dtype
        self.codec = compress.build_chain(declaration.params, n, dtype, key=key, role="worker",
                                          shape=declaration.shape, device=device, rank=core.rank())
        self.reducer = device_reduction(declaration.reducer, declaration.params, n, dtype, key, device)


def device_partitions(name, tensor):
    """[DevicePartition] of ``name`` on ``tensor``'s device, made once; empty when ``name``
    keeps the host path (see the module's docstring)."""
    comm = core.communicator()
    cached = _partitions.setdefault(comm, {})
    where = (name, tensor.device)
    if where not in cached:
        declaration = comm.declaration(name)
        places = comm.partitions(name) if declaration.params.granularity != "entiremodel" else []
        cached[where] = [DevicePartition(declaration, *place, tensor.device) for place in places]
    return cached[where]


def reduces_dense_on_device(name):
    """Whether the communicator sums uncompressed ``name`` where its tensor lives (the
    collective's ``reduce_tensor``; the parameter server's servers sum dense bytes on the host)."""
    comm = core.communicator()
    declaration = comm.declaration(name)
    return comm.sums_tensors_on_device and declaration is not None and not declaration.compressed \
        and declaration.shape is not None


def device_chain_names():
    """The tensors this process has pushed through device chains so far (sorted names)."""
    cached = _partitions.get(core.communicator(), {}) if core.is_initialized() else {}
    return sorted({name for (name, _), parts in cached.items() if parts})


class DevicePushPull:
    """A push_pull of ``tensor`` in place through its device chains: compressed when made,
    decoded on the device by ``wait()``."""

    def __init__(self, tensor, name, parts, average, priority, ctx):
        self.comm = core.communicator()
        declaration = self.comm.declaration(name)
        if tuple(tensor.shape) != declaration.shape or torch_dtype(declaration.dtype) != tensor.dtype:
            raise ValueError(f"push_pull({name!r}): got {tuple(tensor.shape)} {tensor.dtype}, but it "
                             f"was first used as {declaration.shape} {declaration.dtype}")
        self.tensor, self.parts = tensor, parts
        self.ctx = ctx
        flat = tensor.detach().reshape(-1)
        wire = flat.to(torch_dtype(declaration.wire_dtype))  # fp16 on the wire: a cast copy
        # the result is decoded into the tensor itself when it can hold the wire values
        self.direct = wire.data_ptr() == tensor.data_ptr() and tensor.is_contiguous()
        self.result = wire if self.direct else torch.empty_like(wire)
        # the exchange driver's stages: compressed here, gathered (or pushed) by the
        # communicator, reduced by wait()
        self.divisor = self.comm.averaged_over(self.comm.tensors[name]) if average else None
        self.segment = ResultSegment(parts, ctx, wire, result=self.result, divisor=self.divisor)
        payloads = Driver.encode(self.segment)
        self.segment.flat = None  # the wire copy is done with (held no longer than before)
        if not self.comm.gathers_payloads:  # the parameter server: only the payloads cross,
            # in one copy (one wait for the device) per tensor
            host = torch.cat(payloads).cpu().numpy() if len(payloads) > 1 else payloads[0].cpu().numpy()
            payloads = np.split(host, np.cumsum([p.numel() for p in payloads])[:-1])
        self.handle = self.comm.push_payloads(name, payloads, ctx, priority)

    def poll(self):
        return self.handle.poll()

    def end_group(self):
        self.handle.end_group()

    @torch.no_grad()
    def wait(self):
        replies = self.handle.wait()
        divisor = self.divisor
        if self.comm.gathers_payloads:  # every rank's payloads: the server's reduction, here
            Driver.reduce_segment(self.segment, replies)
        else:  # the servers' replies
            for part, (reply, compressed) in zip(self.parts, replies):
                dest = self.result[part.start:part.stop]
                reply = torch.from_numpy(reply if reply.flags.writeable else reply.copy()).to(self.tensor.device)
                if compressed:
                    part.reducer.decode(reply, dest, self.ctx)
                else:  # a dense reply (an asynchronous server's snapshot)
                    dest.copy_(reply.view(dest.dtype))
            if divisor is not None and self.parts[0].reducer.summed:
                self.result /= divisor
        if not self.direct:
            self.tensor.copy_(self.result.view(self.tensor.shape))
        return self.tensor
