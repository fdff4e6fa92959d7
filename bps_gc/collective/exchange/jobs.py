"""What the exchange's driver (driver.py) takes, in named fields: a ``Job`` is one exchange (one
all_gather of its payloads on a process group); its ``segments`` are the flat buffers whose parts
it carries, each compressed, reduced and delivered on its own:

    Segment         a flat array and its parts (the collective's declared tensor: its wire copy,
                    the result delivered into the caller's ``out``: ArraySegment; push_pull's
                    through device chains: ResultSegment; its device payloads: GatheredSegment)
    TensorSegment   a flat torch tensor (a DDP bucket, CompressedExchange's named tensors), read
                    in the codecs' dtype on the compressing thread, written with the average
    Job             the collective's bucket: errors raised (its bucket's), no future
    TensorJob       a pipeline call: its future, CUDA side stream, capacity, two levels
"""
import dataclasses
from typing import Any, Callable, Optional

import numpy as np
import torch

from .tensors import TORCH_OF, settle, wire_dtype, wire_torch


@dataclasses.dataclass(eq=False)
class Segment:
    """``parts`` (coded.CodedPart, or the collective's partitions) of the flat ``flat``, compressed
    with the step context ``ctx``; ``payloads`` this rank's (or ``failure``, its codec's error),
    made on the compressing thread, or as the collective adds it."""
    parts: list
    ctx: dict
    flat: Any = None
    payloads: Optional[list] = None
    failure: Optional[BaseException] = None

    @property
    def compressed(self):
        return self.payloads is not None or self.failure is not None

    def abandon(self, error):
        """Ended by ``error`` (job_thread.JobThread: compressing it could not be called)."""
        if self.failure is None:
            self.failure = error

    def load(self):
        """The array its parts are compressed from (None: not compressed here)."""
        return self.flat

    def target(self):
        """Where the reduction is decoded, and by what a summed result is divided (None: not
        here); no target: the segment is not reduced here (GatheredSegment)."""
        return self.flat, None

    def deliver(self, reduced):
        """The decoded ``reduced`` to where the caller wants it (without a target: every rank's
        payloads)."""


@dataclasses.dataclass(eq=False)
class ResultSegment(Segment):
    """Compressed from ``flat``, reduced into ``result`` and divided by ``divisor`` (push_pull
    through device chains: torch/device.py, decoded into the tensor or a copy)."""
    result: Any = None
    divisor: Optional[int] = None

    def target(self):
        return self.result, self.divisor


@dataclasses.dataclass(eq=False)
class GatheredSegment(Segment):
    """Payloads a binding compressed on its device (the collective's push_payloads: ``parts``
    its partitions, ``payloads`` given), gathered on their device; every rank's land in
    ``result`` (rank order) for the binding to reduce on its own thread. ``name``: the tensor's."""
    result: list = None
    name: str = ""

    def target(self):
        return None, None

    def deliver(self, gathered):
        self.result.extend(gathered)


@dataclasses.dataclass(eq=False)
class ArraySegment(Segment):
    """A declared tensor's wire copy (``flat``, the result decoded into it), delivered into
    ``out`` by ``into`` (the collective's Buckets.deliver), averaged when ``average`` and its
    reducer sums (a majority vote is not averaged). ``name``: the tensor's, for messages."""
    out: Any = None
    average: bool = False
    into: Callable = None
    name: str = ""

    def deliver(self, reduced):
        self.into(reduced, self.out, self.average and self.parts[0].reducer.summed)


@dataclasses.dataclass(eq=False)
class TensorSegment(Segment):
    """A flat torch tensor ``buffer`` whose parts are compressed in its wire dtype (``fp16``:
    float16), on its device (``on_device``: device chains) or as numpy; with ``two_levels`` its
    owners compress the host's sums instead (two_levels.py). The average (over ``divisor``
    ranks) is written back into ``buffer``. ``keys``: each part's seed key, its two-level owner."""
    buffer: Any = None
    fp16: bool = False
    on_device: bool = False
    two_levels: bool = False
    divisor: int = 1
    keys: tuple = ()
    grad: Any = None  # the buffer in the codecs' dtype (a view where it already is)
    direct: bool = False  # decoded straight into the buffer (target)

    @property
    def partitions(self):  # what comm.phased reads
        return self.parts

    def load(self):
        buffer = self.buffer
        if self.two_levels:  # float32 (float64 for a float64 buffer) on CPU: a view
            self.grad = buffer.detach().to("cpu", wire_torch(buffer, False))
            return None
        self.grad = buffer.detach().to(wire_torch(buffer, self.fp16))  # its own dtype: a view
        self.flat = self.grad if self.on_device else self.grad.cpu().numpy()
        return self.flat

    def target(self):
        """Device: a fresh tensor. Host: straight into the buffer where it holds the wire dtype
        (the compressing thread is done with it), else a host array, then copied."""
        if self.on_device:
            return torch.empty_like(self.grad), self.divisor
        wire, buffer = wire_dtype(self.buffer, self.fp16), self.buffer
        self.direct = buffer.device.type == "cpu" and buffer.is_contiguous() and buffer.dtype == TORCH_OF[wire]
        return (buffer.detach().numpy() if self.direct else np.empty(self.grad.numel(), wire)), self.divisor

    def deliver(self, reduced):
        if not self.direct:
            self.buffer.copy_(reduced if self.on_device else torch.from_numpy(reduced))


@dataclasses.dataclass(eq=False)
class Job:
    """One exchange: ``segments``' payloads in one all_gather on ``group`` (None: the world), or
    with ``destinations`` (each part's rank in ``group``, every segment's parts in turn) one
    all_to_all that sends each payload to that rank alone (``rank``: this one's in ``group``);
    each collective waited for by ``wait(work, what)``. ``capacity``: the all_gather.Capacity
    (None: two all_gathers); ``device``: where device payloads are gathered; ``levels``: the
    HostLevels it is reduced through (two_levels.py), or None. ``index``: the timeline's key.
    ``skipped``: None, or the label of a gather this rank skips (two levels' step across hosts
    where nothing crosses: one host, or no part owned here): its payloads are the only ones."""
    segments: list
    wait: Callable
    group: Any = None
    capacity: Any = None
    device: Any = None
    levels: Any = None
    index: Any = None
    stream: Any = None  # tensors.SideStream of a CUDA buffer, or None
    skipped: Optional[str] = None
    destinations: Optional[tuple] = None
    rank: int = 0
    gathered: Optional[list] = None  # every rank's payloads, rank order (the gather stage's)
    error: Optional[BaseException] = None  # the gather stage's, raised by the reduce stage

    def payloads_missing(self, missing, failure):
        """Raise what a rank ends with when some rank made no payloads: this rank's own codec
        error says more than the ranks' list."""
        if failure is not None:
            raise failure from None
        raise missing

    def settle(self, work):
        """The job's end: ``work(job)``, its errors raised to the caller (the collective's bucket)."""
        work(self)

    def abandon(self, error):
        """Ended by ``error`` (job_thread.JobThread: a stage could not be called)."""
        if self.error is None:
            self.error = error

    def result(self):
        return None


@dataclasses.dataclass(eq=False)
class TensorJob(Job):
    """A pipeline call on one TensorSegment, ending in ``future`` (the buffer, averaged)."""
    future: Any = None

    @property
    def segment(self):
        return self.segments[0]

    def payloads_missing(self, missing, failure):
        if failure is not None:
            raise RuntimeError(f"bps_gc comm_hook: compressing DDP bucket {self.index} failed: "
                               f"{type(failure).__name__}: {failure}") from failure
        raise RuntimeError(f"bps_gc comm_hook: DDP bucket {self.index}: {missing} (their errors name "
                           "the cause); this rank stops too") from None

    def settle(self, work):
        settle(self.future, work, self)

    def abandon(self, error):
        super().abandon(error)
        if not self.future.done():
            self.future.set_exception(error)

    def result(self):
        return self.segment.buffer
