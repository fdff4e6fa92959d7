"""The DDP hook's buckets of a codec whose reducer sums in plain phases (comm/phased.py: thc's
scale histogram, then its packed codes; PowerSGD's P, then Q): each phase of the whole bucket
is one all_reduce (thc: of int64 words; PowerSGD: float32) over the hook's own group, on the
exchanging thread (the one issuing the hook's collectives), so no payload is gathered. Each
gradient is a partition (keys as gradient_codecs.py's ``bucket_key``; PowerSGD views it in its
parameter's shape) with a float32 numpy chain on the host (the codes are the wire: ``fp16``
changes nothing); the bucket's average is written back into DDP's buffer. With two levels
(hook_two_levels.py), for thc (``host_first``), each gradient's owner local rank (by its seed key)
sums it over the host in shared memory, encodes that sum, and sums its phase buffers with the
owners of the other hosts (one summand per host: comm/phased.py ``host_first``); then the host
copies the decoded gradients out.
"""
import dataclasses

import torch
import torch.distributed as dist

from ...comm.phased import PhasedReduction, run_phases
from ...collective.reductions import WORDS
from .futures import current, settle, value
from .gradient_codecs import coded_parts, key_maker, key_owner


@dataclasses.dataclass
class PhasedBucket:
    """What the phased part keeps for DDP bucket ``index`` across steps; made again when its
    ``sizes`` or gradients change (DDP regroups after the first step)."""
    sizes: list  # the numel of each gradient of the bucket
    gradients: list  # the ids its gradients' codecs are kept under (GradientCodecs.gradient_ids)
    codecs: list  # [gradient_codecs.GradientCodec], one per gradient, in bucket order (reducer None)
    partitions: list  # [coded.CodedPart] (codec: the worker chain): what comm.phased.PhasedReduction reads


class PhasedBuckets:
    """CompressionHook's part for a codec whose reducer sums in plain phases in the hook (thc).

    Made from ``codecs`` (the hook's gradient_codecs.GradientCodecs), ``current_lr()`` (the learning
    rate of a call), ``exchanger`` (the hook's exchanging JobThread), ``traffic``
    (core.hook_traffic), and the hook's ``pending_future(buffer)`` (pending future, CUDA side stream),
    ``side_group(group)`` (its own process group of DDP's) and ``waiter(group, index)`` (the
    wait of a bucket's collectives). ``call(group, bucket, buffer)`` is the hook's call for a
    bucket: a future of its average; ``forget()`` drops the buckets (made again from the
    codecs, as after loading a checkpoint)."""

    def __init__(self, codecs, current_lr, exchanger, traffic, future, side_group, waiter, host_first):
        self.codecs, self.current_lr, self.exchanger, self.traffic = codecs, current_lr, exchanger, traffic
        self.host_first = host_first  # thc: two levels sum the host first; PowerSGD's phases run flat
        self.pending_future, self.side_group, self.waiter = future, side_group, waiter
        self.buckets = {}  # bucket index -> its PhasedBucket

    def forget(self):
        self.buckets.clear()

    def call(self, group, bucket, buffer, levels=None):
        index, grads = bucket.index(), bucket.gradients()
        shapes, sizes = [tuple(g.shape) for g in grads], [g.numel() for g in grads]
        gradients = self.codecs.gradient_ids(bucket, index, len(sizes))
        state = self.buckets.get(index)
        if state is None or state.sizes != sizes or state.gradients != gradients:
            # each gradient's chain is its own (gradient_codecs.py), kept when DDP regroups and saved by name
            codecs, _ = self.codecs.codecs_for(index, gradients, sizes, buffer, key_maker(bucket, index), shapes)
            state = self.buckets[index] = PhasedBucket(sizes, gradients, codecs, coded_parts(codecs))
        ctx = {"lr": self.current_lr(), "step": self.codecs.next_step(state.codecs)}
        side = self.side_group(group)
        future, stream = self.pending_future(buffer)
        levels = levels if self.host_first else None
        self.exchanger.submit(lambda: self._stage(side, index, buffer, state, ctx, future, stream, levels))
        return future.then(value)

    def _stage(self, group, index, buffer, tensor, ctx, future, stream, levels):
        wait = self.waiter(group, index)
        level_wait = (lambda work, what: None if work is None else wait(work, what))  # None: skipped
        what = f"all_reduce of DDP bucket {index}'s thc phase"

        def summed(fused):  # one level: every rank's phase buffers
            wait(dist.all_reduce(torch.from_numpy(fused), group=group, async_op=True), what)
            self.traffic.add(pushed_wire=fused.nbytes, pulled_wire=fused.nbytes)  # core.metrics()

        def across_hosts(fused):  # two levels: the owners' buffers, with those of the other hosts
            if levels.hosts > 1 and fused.size:
                level_wait(dist.all_reduce(torch.from_numpy(fused), group=levels.cross_group, async_op=True), what)
                self.traffic.add(pushed_wire=fused.nbytes, pulled_wire=fused.nbytes)
            else:  # every rank counts the collective alike
                level_wait(None, what)

        def work():
            if stream is not None:
                stream[0].wait_event(stream[1])
            grad = buffer.detach().to("cpu", torch.float32).numpy().copy()
            raw = buffer.numel() * buffer.element_size()
            self.traffic.add(pushed_raw=raw, pulled_raw=raw)
            size = dist.get_world_size(group)
            if levels is None:
                run_phases([PhasedReduction(tensor, grad, grad, ctx, size, carrier=WORDS)], summed)
            else:  # each gradient's owner by its seed key (gradient_codecs.key_owner)
                parts = [part._replace(owner=key_owner(codec.key, levels.local_size))
                         for part, codec in zip(tensor.partitions, tensor.codecs)]

                def across(result, mine):
                    owned = [part for part in parts if part.owner == levels.local_rank]
                    run_phases([PhasedReduction(tensor, result, result, ctx, size // levels.local_size, owned,
                                                WORDS)], across_hosts)
                levels.reduce_owned_into([grad], [(grad, None)], parts, across, level_wait)
            grad /= grad.dtype.type(size)
            buffer.copy_(torch.from_numpy(grad))
            return buffer
        with current(stream):
            settle(future, work)
