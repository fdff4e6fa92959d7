"""Decentralized training in PyTorch: CHOCO-SGD and plain D-PSGD (spec §5).

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    opt = bps.DecentralizedOptimizer(opt, model.named_parameters(), algorithm="choco",
                                     topology="ring", consensus_stepsize=0.45,
                                     compression_params={"compressor": "signnorm"})

``step()`` runs the wrapped optimizer (the local step, its momentum buffers never leave the
node), then one gossip round with the graph neighbours through the communicator's send/recv
(bps_gc.core.send/recv: worker to worker, no server). CHOCO's messages are collected at the
next step, so they travel during the next forward and backward pass; ``finish()`` collects the
last ones. Parameters are gossiped; buffers (BatchNorm statistics) stay local.

Where the parameters' codecs run on their device (BPS_GC_DEVICE_CODECS, docs/device_codecs.md:
CUDA tensors by default), CHOCO's state (xhat, s - xhat) and arithmetic stay on the device too
(``DeviceChocoGossip``): only the payloads cross to the host, to be sent; received ones are
decoded on the device. Otherwise the gossip updates CPU parameters in place through numpy views.
D-PSGD sends whole models: on the device (``DeviceDPSGDGossip``) each round's model crosses to
the host to be sent, and the neighbours' models are mixed in on the device.
"""
import numpy as np
import torch

import bps_gc.core as core

from ..algorithms.gossip import ChocoGossip, DPSGDGossip, pack
from ..algorithms.topology import topology as make_topology
from .checkpoint import register
from .device import chain_for, uses_device_chain
from .ops import SUPPORTED
from .wrapper import WrappingOptimizer

NUMPY_DTYPES = {torch_dtype: np.dtype(np_dtype) for torch_dtype, np_dtype in SUPPORTED.items()}

ALGORITHMS = ("choco", "dpsgd")


class CoreComm:
    """The gossip's view of this process's communicator (bps_gc.core's public calls)."""

    def rank(self):
        return core.rank()

    def size(self):
        return core.size()

    def send(self, rank, name, payload):
        return core.send(rank, name, payload)

    def recv(self, rank, name, timeout=None):
        return core.recv(rank, name, timeout)

    def average(self, name, array):
        core.declare(name, shape=array.shape, dtype=array.dtype)  # alike again: a no-op
        return core.push_pull(array, name, average=True).wait()


class DecentralizedOptimizer(WrappingOptimizer):
    """Wraps a local optimizer (its ``param_groups`` and ``state`` are shared, so learning-rate
    schedulers and checkpoints see the wrapped one). ``algorithm``: "choco" (compressed with
    ``compression_params``, any bps_gc codec) or "dpsgd" (uncompressed neighbour averaging).
    ``topology``: "ring", "torus", "complete", an edge list "0-1,1-2" or a Topology. ``name``
    tags its messages (two of them in one job need different names)."""

    def __init__(self, optimizer, named_parameters, algorithm="choco", topology="ring",
                 consensus_stepsize=0.45, compression_params=None, communicator=None, name=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DecentralizedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self._wrap(optimizer)
        self.comm = communicator or CoreComm()
        named = sorted(named_parameters, key=lambda kv: kv[0])
        on_device = any(uses_device_chain(p) for _, p in named)
        arrays = {}
        for pname, p in named:  # (``name`` is the messages' tag)
            if (p.device.type != "cpu" and not on_device) or not p.is_contiguous() or p.dtype not in SUPPORTED:
                where = "contiguous float tensor" if on_device else "contiguous CPU float tensor"
                raise ValueError(f"DecentralizedOptimizer ({algorithm}): {pname!r} must be a {where} "
                                 f"(got {p.dtype} on {p.device}, contiguous: {p.is_contiguous()})")
            arrays[pname] = p.detach().view(-1) if on_device else p.detach().numpy().reshape(-1)
        self.params = dict(named)
        self.topology = make_topology(topology, self.comm.size())
        self.algorithm = algorithm
        if on_device and algorithm == "choco":
            self.gossip = DeviceChocoGossip(arrays, self.topology, self.comm, consensus_stepsize,
                                            compression_params, tag=name or "choco")
        elif algorithm == "choco":
            self.gossip = ChocoGossip(arrays, self.topology, self.comm, consensus_stepsize, compression_params,
                                      tag=name or "choco")
        else:
            if compression_params and compression_params.get("compressor"):
                raise ValueError("D-PSGD exchanges uncompressed models; use algorithm='choco' to compress")
            gossip = DeviceDPSGDGossip if on_device else DPSGDGossip
            self.gossip = gossip(arrays, self.topology, self.comm, tag=name or "dpsgd")
        register(self, "DecentralizedOptimizer")

    def step(self, closure=None):
        with torch.no_grad():
            loss = self.optimizer.step(closure)
            self.gossip.step(float(self.param_groups[0]["lr"]))
        return loss

    def finish(self):
        """Collect the messages still in flight (before evaluating or leaving)."""
        self.gossip.collect()

    def bytes_sent(self):
        """Gossip bytes this node sent since it started (all neighbours)."""
        return self.gossip.bytes_sent

    def averaged_parameters(self):
        """{name: tensor} of the parameters averaged over all workers (a reduce through the
        communicator, for evaluating the average model; every worker must call it)."""
        self.finish()
        out = {}
        for name, p in self.params.items():
            array = p.detach().cpu().numpy().copy()
            self.comm.average(f"DecentralizedAverage.{name}", array)
            out[name] = torch.from_numpy(np.asarray(array).reshape(tuple(p.shape))).to(p.device)
        return out


class RawDeviceCodec:
    """CHOCO without a compressor on the device: the payload is the float bytes themselves."""

    def __init__(self, dtype):
        self.dtype = dtype

    def compress(self, x, lr=0.0):
        return x.contiguous().view(torch.uint8).clone()

    def decompress(self, payload, out):
        if not isinstance(payload, torch.Tensor):  # received bytes (read-only): a copy
            payload = torch.tensor(np.asarray(payload, np.uint8))
        return out.copy_(payload.to(out.device).view(self.dtype))


class DeviceChocoGossip(ChocoGossip):
    """ChocoGossip (algorithms/gossip.py) on flat torch tensors, its Q a device codec chain:
    the same rounds and messages, each step's arithmetic in the same order and dtype."""

    _zeros_like = staticmethod(torch.zeros_like)

    @staticmethod
    def _codec(params, a, key):
        """The numpy variant's codec (its seed ``key``) as a device chain, or the raw floats."""
        if params.compressed:
            return chain_for(params, a.numel(), NUMPY_DTYPES[a.dtype], key, "worker", a)
        return RawDeviceCodec(a.dtype)

    def _scratch_buffers(self):
        largest = max((a.numel() for a in self.x.values()), default=0)
        return {(a.dtype, a.device): torch.empty(largest, dtype=a.dtype, device=a.device) for a in self.x.values()}

    def _check_array(self, name, a):
        _check_tensor(name, a)

    def _decoded(self, name, payload):
        a = self.x[name]
        return self.codecs[name].decompress(payload, self._scratch[a.dtype, a.device][:a.numel()])

    def _weighted(self, name, payload, w):
        """ChocoGossip.collect's term: the neighbour's q_j (a host payload) decoded on the device."""
        return self._decoded(name, payload) * w

    def step(self, lr=0.0):
        """ChocoGossip.step on the device; only the payloads come to the host, to be sent."""
        self.collect()
        payloads = []
        for name in self.names:
            x, xhat, u = self.x[name], self.xhat[name], self.u[name]
            x += u * self.gamma
            payload = self.codecs[name].compress(x - xhat, float(lr))
            q = self._decoded(name, payload)
            xhat += q
            u -= q * (1.0 - self.w_self)
            payloads.append(payload.cpu().numpy())
        self._send_all(pack(payloads))
        self.pending = True
        self.rounds += 1


__all__ = ["DecentralizedOptimizer"]


def _check_tensor(name, a):
    if not (isinstance(a, torch.Tensor) and a.dim() == 1 and a.is_contiguous()):
        raise ValueError(f"gossip: {name!r} must be a flat contiguous tensor")


class DeviceDPSGDGossip(DPSGDGossip):
    """DPSGDGossip (algorithms/gossip.py) on flat torch tensors: the same messages and mixing,
    in the same order and dtype, on the device."""

    def _check_array(self, name, a):
        _check_tensor(name, a)

    def step(self, lr=0.0):
        self._send_all(pack([a.cpu().numpy().view(np.uint8) for a in self.x.values()]))
        mixed = {n: a * self.w_self for n, a in self.x.items()}
        for j in self.neighbours:
            w = self.topology.weight(self.rank, j)
            for name, payload in zip(self.names, self._receive(j)):
                a = self.x[name]
                mixed[name] += torch.tensor(np.asarray(payload, np.uint8)).to(a.device).view(a.dtype) * w
        self._wait_sent()
        for n, a in self.x.items():
            a.copy_(mixed[n])
        self.rounds += 1

