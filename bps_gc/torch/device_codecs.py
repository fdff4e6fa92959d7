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
import dataclasses
import weakref

import numpy as np
import torch

import bps_gc.core as core

from .. import compress
from ..compress.device import torch_dtype
from ..compress.state import Stateful

_partitions = weakref.WeakKeyDictionary()  # communicator -> {(name, device): [DevicePartition]}


def uses_device_chain(tensor):
    """Whether ``tensor``'s codecs run as torch operations on its device."""
    mode = core.device_codecs()
    return mode == "torch" or (mode == "auto" and tensor.device.type != "cpu")


def chain_for(params, n, dtype, key, role, tensor, shape=None):
    """The codec chain of one partition of ``tensor``: a device chain on its device when
    ``uses_device_chain(tensor)``, else the numpy chain (``dtype``: a numpy dtype)."""
    device = {"device": tensor.device} if uses_device_chain(tensor) else {}
    return compress.build_chain(params, n, dtype, key=key, role=role, shape=shape, **device)


# ---------------------------------------------------------------- reductions on the device


class DeviceRecompress(Stateful):
    """compress.reducers.Recompress on the device: decode every push, sum them in rank order,
    re-encode with the server's chain (its error feedback included), decode that. Its state
    (checkpoints) is the server chain's, as the numpy reducer's."""
    summed = True

    def state_identity(self):
        return {"reducer": type(self).__name__.removeprefix("Device").lower(), "n": self.n, "dtype": str(self.dtype),
                "params": self.params.to_json().decode()}

    def state_children(self):
        return (("chain.", self.server),) if type(self) is DeviceRecompress else ()

    @property
    def server(self):
        if self._server is None:
            self._server = self._chain(self.params)
        return self._server

    def __init__(self, params, n, dtype, key, device):
        self.params, self.n, self.dtype, self.key, self.device = params, n, dtype, key, device
        self._decoder = self._server = None

    def _chain(self, params):
        return compress.build_chain(params, self.n, self.dtype, key=self.key, role="server",
                                    device=self.device)

    @property
    def decoder(self):  # a payload decodes without the decorators' state
        if self._decoder is None:
            self._decoder = self._chain(dataclasses.replace(self.params, ef=None, momentum=None, mu=None))
        return self._decoder

    def total(self, payloads, chain):
        acc = torch.zeros(self.n, dtype=torch_dtype(self.dtype), device=self.device)
        for payload in payloads:
            chain.decompress_add(payload, acc)
        return acc

    def decode(self, reply, out, ctx):
        self.decoder.decompress(reply, out=out)

    def reduce(self, payloads, out, ctx):
        self.decode(self.server.compress(self.total(payloads, self.server), ctx), out, ctx)


class DeviceLossless(DeviceRecompress):
    """compress.reducers.Lossless: the exact sum of the decoded pushes. Its reply is the dense
    sum, or (uint32 index, value) records of its nonzero elements."""

    def decode(self, reply, out, ctx):
        itemsize = self.dtype.itemsize
        if reply.numel() == self.n * itemsize:
            out.copy_(reply.view(torch_dtype(self.dtype)))
            return
        record = 4 + itemsize
        if reply.numel() > self.n * itemsize or reply.numel() % record:
            raise ValueError(f"lossless reply of {reply.numel()} bytes is neither {self.n * itemsize} "
                             f"dense bytes nor whole {record}-byte records")
        records = reply.view(-1, record)
        index = records[:, :4].contiguous().view(torch.int32).reshape(-1).long() & 0xFFFFFFFF
        if index.numel() and int(index.max()) >= self.n:
            raise ValueError("lossless reply: index out of range")
        out.zero_()
        out[index] = records[:, 4:].contiguous().view(torch_dtype(self.dtype)).reshape(-1)

    def reduce(self, payloads, out, ctx):  # the reply would be this sum, exactly
        out.copy_(self.total(payloads, self.decoder))


class DeviceMajority(DeviceRecompress):
    """compress.reducers.Majority: the sign of the sum of the decoded pushes' signs (+1 on a
    tie), NaN everywhere when a push held a non-finite value; never averaged."""
    summed = False

    def decode(self, reply, out, ctx):
        size = -(-self.n // 8) + 1
        if reply.numel() != size:
            raise ValueError(f"majority reply of {reply.numel()} bytes, expected {size} for {self.n} elements")
        shifts = torch.arange(7, -1, -1, device=reply.device, dtype=torch.uint8)
        negative = ((reply[:-1, None] >> shifts) & 1).reshape(-1)[:self.n]
        signs = 1 - 2 * negative.to(out.dtype)
        out.copy_(torch.where(reply[-1] > 0, torch.full_like(signs, float("nan")), signs))

    def reduce(self, payloads, out, ctx):
        votes = torch.zeros(self.n, dtype=torch.int32, device=self.device)
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for payload in payloads:
            x = self.decoder.decompress(payload)
            votes += (x > 0).int() - (x < 0).int()
            finite &= torch.isfinite(x).all()
        signs = torch.where(votes < 0, -1.0, 1.0).to(out.dtype)
        out.copy_(torch.where(finite, signs, torch.full_like(signs, float("nan"))))


class HostReduction(Stateful):
    """Any other reducer (a plugin's): its numpy implementation on host copies; the one place
    where a device partition's decoded values cross to the host and back."""

    def state_children(self):
        return (("", self.reducer),)

    def __init__(self, name, params, n, dtype, key, device):
        self.reducer = compress.make_reducer(name, params, n, dtype, key)
        self.summed, self.n, self.dtype = self.reducer.summed, n, dtype

    def decode(self, reply, out, ctx):
        host = np.empty(self.n, self.dtype)
        self.reducer.decode(reply.cpu().numpy(), host, ctx)
        out.copy_(torch.from_numpy(host))

    def reduce(self, payloads, out, ctx):
        reply = self.reducer.reduce([p.cpu().numpy() for p in payloads], True, ctx)
        self.decode(torch.from_numpy(np.ascontiguousarray(reply, np.uint8)), out, ctx)


DEVICE_REDUCERS = {"recompress": DeviceRecompress, "lossless": DeviceLossless, "majority": DeviceMajority}


def device_reduction(name, params, n, dtype, key, device):
    """The reducer ``name`` of one partition, decoding (and, for the collective, reducing) on
    ``device``; reducers without a device implementation run on host copies."""
    if name in DEVICE_REDUCERS:
        return DEVICE_REDUCERS[name](params, n, np.dtype(dtype), key, device)
    return HostReduction(name, params, n, dtype, key, device)


# ---------------------------------------------------------------- push_pull


class DevicePartition:
    def __init__(self, declaration, key, start, stop, device):
        self.key, self.start, self.stop = key, start, stop
        n, dtype = stop - start, declaration.wire_dtype
        self.chain = compress.build_chain(declaration.params, n, dtype, key=key, role="worker",
                                          shape=declaration.shape, device=device)
        self.reduction = device_reduction(declaration.reducer, declaration.params, n, dtype, key, device)


def device_partitions(name, tensor):
    """[DevicePartition] of ``name`` on ``tensor``'s device, made once; empty when ``name``
    keeps the host path (see the module's docstring)."""
    comm = core.worker()
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
    comm = core.worker()
    declaration = comm.declaration(name)
    return hasattr(comm, "reduce_tensor") and declaration is not None and not declaration.compressed \
        and declaration.shape is not None


def device_chain_names():
    """The tensors this process has pushed through device chains so far (sorted names)."""
    cached = _partitions.get(core.worker(), {}) if core.is_initialized() else {}
    return sorted({name for (name, _), parts in cached.items() if parts})


class DevicePushPull:
    """A push_pull of ``tensor`` in place through its device chains: compressed when made,
    decoded on the device by ``wait()``."""

    def __init__(self, tensor, name, parts, average, priority, ctx):
        self.comm = core.worker()
        declaration = self.comm.declaration(name)
        if tuple(tensor.shape) != declaration.shape or torch_dtype(declaration.dtype) != tensor.dtype:
            raise ValueError(f"push_pull({name!r}): got {tuple(tensor.shape)} {tensor.dtype}, but it "
                             f"was first used as {declaration.shape} {declaration.dtype}")
        self.tensor, self.parts, self.average = tensor, parts, average
        self.ctx = ctx
        flat = tensor.detach().reshape(-1)
        wire = flat.to(torch_dtype(declaration.wire_dtype))  # fp16 on the wire: a cast copy
        # the result is decoded into the tensor itself when it can hold the wire values
        self.direct = wire.data_ptr() == tensor.data_ptr() and tensor.is_contiguous()
        self.result = wire if self.direct else torch.empty_like(wire)
        payloads = [part.chain.compress(wire[part.start:part.stop], ctx) for part in parts]
        if not self.comm.gathers_payloads:  # the parameter server: only the payloads cross,
            # in one copy (one wait for the device) per tensor
            host = torch.cat(payloads).cpu().numpy() if len(payloads) > 1 else payloads[0].cpu().numpy()
            payloads = np.split(host, np.cumsum([p.numel() for p in payloads])[:-1])
        self.handle = self.comm.push_payloads(name, payloads, ctx, priority)

    def poll(self):
        return self.handle.poll()

    @torch.no_grad()
    def wait(self):
        replies = self.handle.wait()
        device = self.tensor.device
        for index, part in enumerate(self.parts):
            dest = self.result[part.start:part.stop]
            if self.comm.gathers_payloads:
                part.reduction.reduce([rank[index] for rank in replies], dest, self.ctx)
                continue
            reply, compressed = replies[index]
            reply = torch.from_numpy(reply if reply.flags.writeable else reply.copy()).to(device)
            if compressed:
                part.reduction.decode(reply, dest, self.ctx)
            else:  # a dense reply (an asynchronous server's snapshot)
                dest.copy_(reply.view(dest.dtype))
        if self.average and self.parts[0].reduction.summed:
            self.result /= self.comm.size
        if not self.direct:
            self.tensor.copy_(self.result.view(self.tensor.shape))
        return self.tensor
