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
CPU tensors only: the gossip updates the parameters' memory in place through numpy views.
"""
import numpy as np
import torch

import bps_gc.core as core

from ..bindings.gossip import ChocoGossip, DPSGDGossip
from ..bindings.topology import topology as make_topology
from .ops import SUPPORTED
from .wrapper import WrappingOptimizer

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
        arrays = {}
        for name, p in named:
            if p.device.type != "cpu" or not p.is_contiguous() or p.dtype not in SUPPORTED:
                raise ValueError(f"DecentralizedOptimizer: {name!r} must be a contiguous CPU float tensor "
                                 f"(got {p.dtype} on {p.device})")
            arrays[name] = p.detach().numpy().reshape(-1)
        self.params = dict(named)
        self.topology = make_topology(topology, self.comm.size())
        self.algorithm = algorithm
        if algorithm == "choco":
            self.gossip = ChocoGossip(arrays, self.topology, self.comm, consensus_stepsize, compression_params,
                                      tag=name or "choco")
        else:
            if compression_params and compression_params.get("compressor"):
                raise ValueError("D-PSGD exchanges uncompressed models; use algorithm='choco' to compress")
            self.gossip = DPSGDGossip(arrays, self.topology, self.comm, tag=name or "dpsgd")

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
            array = p.detach().numpy().copy()
            self.comm.average(f"DecentralizedAverage.{name}", array)
            out[name] = torch.from_numpy(np.asarray(array).reshape(tuple(p.shape)))
        return out


__all__ = ["DecentralizedOptimizer"]
