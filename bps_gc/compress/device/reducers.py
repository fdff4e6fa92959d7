"""The reducers' device versions: a partition's server reduction run with torch operations on
its device (the collective reduces every rank's payloads there; the parameter server's workers
decode the servers' replies there), beside the numpy reducers of compress/reducers.py."""
import dataclasses

import numpy as np
import torch

from ..chain import build_chain
from ..reducers import make_reducer
from ..scratch import use_scratch
from ..stateful import Stateful
from .base import shared_tensor, torch_dtype


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
        self.scratch = None  # or a compress.Scratch shared with other partitions' reducers

    def _chain(self, params):
        chain = build_chain(params, self.n, self.dtype, key=self.key, role="server", device=self.device)
        use_scratch(chain, self.scratch)
        return chain

    @property
    def decoder(self):  # a payload decodes without the decorators' state
        if self._decoder is None:
            self._decoder = self._chain(dataclasses.replace(self.params, ef=None, momentum=None, mu=None))
        return self._decoder

    def total(self, payloads, chain):
        if self.scratch is not None:
            acc = shared_tensor(self.scratch, "sum", self.n, torch_dtype(self.dtype), self.device).zero_()
        else:
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
        self.reducer = make_reducer(name, params, n, dtype, key)
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
