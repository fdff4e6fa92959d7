"""Pushes a binding compressed itself, and their replies left undecoded.

bps_gc.torch compresses a CUDA tensor's partitions with device codec chains (docs/device_codecs.md):
only the payloads come to the host. ``push_payloads`` sends them as the worker's own codec pool
would (same keys, rounds, priorities and step context); the servers reduce them as always, and
the handle's ``wait()`` returns each partition's reply as it arrived, for the binding to decode
on its device. The numpy path (``Worker.reduce``) is untouched.
"""
import numpy as np

from ...comm.phased import phases
from ...comm.placement import MAX_PARTITIONS
from ...wire.wire import encode_context
from .commands import SendPush
from .handle import Handle
from .push import Push


class PulledPayloads(Handle):
    """A push_payloads in flight: ``wait()`` returns [(reply, compressed)] per partition, the
    reply a uint8 numpy array (``compressed`` False: the partition's raw elements, e.g. an
    asynchronous server's dense snapshot)."""

    def __init__(self, worker, tensor, count, ctx):
        empty = np.empty(0, tensor.wire_dtype)  # no arrays to fill: wait() returns ``out``
        super().__init__(worker, tensor, empty, empty, count, False, ctx)
        self.out = [None] * count

    def partition_replied(self, push, payload, compressed, seconds):
        """On the I/O thread: keep the reply (no decoding here)."""
        raw = push.part.n * push.dtype.itemsize
        self.worker.counters.add(communicate_seconds=seconds, pulled_raw=raw,
                                 pulled_wire=len(payload) if compressed else raw)
        self.out[push.part.key & (MAX_PARTITIONS - 1)] = (np.frombuffer(payload, np.uint8), compressed)
        self.partition_done()


def push_payloads(worker, name, payloads, ctx, priority):
    """Worker.push_payloads: checks, then one Push per partition, as ``CompressedPushes`` posts
    (compressing.py)."""
    worker.check_alive()
    tensor = worker.tensors.get(name)
    if tensor is None:
        raise KeyError(f"push_payloads: {name!r} was not declared; call declare({name!r}, ...) first")
    if worker.io is None or not tensor.compressed or phases(tensor) > 1:
        raise ValueError(f"push_payloads({name!r}): it has no compressed partitions to push "
                         "(see Communicator.partitions)")
    if len(payloads) != len(tensor.partitions):
        raise ValueError(f"push_payloads({name!r}): {len(payloads)} payloads for "
                         f"{len(tensor.partitions)} partitions")
    if tensor.busy:
        raise RuntimeError(f"push_pull({name!r}) while the previous one is still running; wait for it first")
    ctx = dict(worker.codecs.step_context(ctx))
    context = encode_context(ctx)
    payloads = [np.ascontiguousarray(p, np.uint8).reshape(-1) for p in payloads]
    tensor.busy = True
    handle = PulledPayloads(worker, tensor, len(payloads), ctx)
    worker.counters.add(pushed_raw=tensor.size * tensor.wire_dtype.itemsize,
                        pushed_wire=sum(p.nbytes for p in payloads))
    for part, payload in zip(tensor.partitions, payloads):
        worker.io.post(SendPush(Push(handle, part, payload, True, context, priority, tensor.wire_dtype, None)))
    return handle
