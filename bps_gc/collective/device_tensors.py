"""The collective's calls for torch tensors that stay on their device (bps_gc.torch with device
codec chains, docs/device_codecs.md): a part of ``Collective``, whose buckets carry them.

* ``push_payloads``: a tensor's partitions compressed on the device by the binding; their
  payloads are all_gathered as device tensors with the bucket (one all_gather per device), and
  every rank gets every rank's payloads back to run the reducer on the device.
* ``reduce_tensor``: an uncompressed tensor, summed by the bucket's dense all_reduce of its
  dtype on its device.

On CUDA with the NCCL backend neither leaves the GPU; only the payloads' lengths are read back.
"""
import numpy as np
import torch

from .buckets import DenseEntry, Handle
from .exchange.jobs import GatheredSegment


class DeviceTensors:
    """``push_payloads`` and ``reduce_tensor`` into the pending bucket (the payloads gathered by
    the buckets' driver: jobs.GatheredSegment); ``deliver_tensors``, the summed tensors'
    delivery (given to the buckets)."""

    def __init__(self, shared, lifecycle, buckets, tensors, partitions):
        """``shared``: shared.Shared; ``lifecycle``: its checks and waits; ``buckets``: where the
        tensors go (buckets.py: its ``add``); ``tensors``: the communicator's declared tensors by name
        (read only); ``partitions``: the communicator's ``partitions(name)``."""
        self.shared, self.buckets, self.size = shared, buckets, shared.size
        self.tensors, self.partitions = tensors, partitions
        self.check_alive = lifecycle.check_alive
        self.add = buckets.add

    def push_payloads(self, name, payloads, ctx=None, priority=0):
        """Payloads a binding compressed on its device (uint8 tensors, one per partition of
        ``partitions(name)``), gathered with the bucket on that device; ``wait()`` returns,
        per rank, its list of payload tensors (still on the device)."""
        self.check_alive()
        tensor = self.tensors.get(name)
        if tensor is None:
            raise KeyError(f"push_payloads: {name!r} was not declared; call declare({name!r}, ...) first")
        if len(payloads) != len(self.partitions(name)) or not payloads:
            raise ValueError(f"push_payloads({name!r}): {len(payloads)} payloads for "
                             f"{len(self.partitions(name))} compressed partitions")
        if len({p.device for p in payloads}) > 1:
            raise ValueError(f"push_payloads({name!r}): the payloads are on several devices")
        raw = tensor.size * tensor.wire_dtype.itemsize
        counters = self.shared.counters
        counters.pushed_raw += raw
        counters.pulled_raw += raw
        counters.pushed_wire += sum(p.numel() for p in payloads)
        result = []
        handle = Handle(self.buckets, result, self.buckets.pending)
        segment = GatheredSegment(self.partitions(name), None, payloads=payloads, result=result, name=name)
        return self.add(handle, "gathered", segment, raw, name)

    @torch.no_grad()
    def deliver_tensors(self, fused, entries):
        """``Buckets.deliver`` for the tensors of ``reduce_tensor``, on their device."""
        offset = 0
        for entry in entries:
            total = fused[offset:offset + entry.wire.numel()]
            if entry.average:
                total /= self.size
            entry.out.copy_(total.view(entry.out.shape))
            offset += entry.wire.numel()

    def reduce_tensor(self, tensor, name, average=True):
        """Sum (or average) an uncompressed tensor over all ranks in place, where it lives: it
        joins the bucket's dense all_reduce of its dtype on its device (NCCL for CUDA), so it
        never leaves the device (bindings running device codec chains: bps_gc.torch)."""
        self.check_alive()
        declared = self.tensors.get(name)
        if declared is None:
            raise KeyError(f"push_pull: {name!r} was not declared; call declare({name!r}, ...) first")
        if declared.compressed or declared.shape != tuple(tensor.shape) or \
                torch.from_numpy(np.empty(0, declared.dtype)).dtype != tensor.dtype:
            raise ValueError(f"reduce_tensor({name!r}): takes a tensor declared uncompressed with its "
                             f"shape and dtype; got {tuple(tensor.shape)} {tensor.dtype}, declared {declared.shape} "
                             f"{declared.dtype} "
                             f"({'compressed' if declared.compressed else 'dense'})")
        wire_dtype = torch.from_numpy(np.empty(0, declared.wire_dtype)).dtype
        wire = tensor.detach().reshape(-1).to(wire_dtype)
        nbytes = wire.numel() * wire.element_size()
        for counter in ("pushed_raw", "pulled_raw", "pushed_wire", "pulled_wire"):
            setattr(self.shared.counters, counter, getattr(self.shared.counters, counter) + nbytes)
        handle = Handle(self.buckets, tensor, self.buckets.pending)
        return self.add(handle, "entries", DenseEntry(wire, tensor, average), nbytes, name)
