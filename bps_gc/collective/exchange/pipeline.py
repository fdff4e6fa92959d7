"""The compressed exchange on any process group, for callers that hand it a flat tensor cut into
named parts (codecs.Batch): the DDP hook (torch/ddp/hook.py: a DDP bucket), CompressedExchange
(torch/exchange.py: named tensors; FSDP2's shards, DiLoCo's pseudo-gradients).

``Pipeline.submit(group, batch, lr, comm)`` returns a pending torch future of the buffer's average at
once: three threads of the pipeline take the calls in order (driver.py): one compresses, one
gathers (the only one issuing the pipeline's collectives, on a process group of its own with
the caller's ranks, made at the first call on every rank), one reduces, decodes and completes the
futures. So a call's steps never overlap, every rank issues the same collectives in the same
order, and consecutive calls' compressing, gathering and reducing overlap (CUDA buffers run on
a side stream that first waits for the gradients). An error on these threads (a codec's, a
failed peer's) is the future's.

With ``reduce_at`` each part's payloads go to the one rank that reduces it (an all_to_all, not
an all_gather). Without a compressor a call is an all_reduce (float16 with ``fp16``). Phased codecs (thc,
PowerSGD) run their phases on the gathering thread (phased.py). Several ranks per host
(two_levels.py): a group of every rank reduces through the two levels on the gathering thread.
Device-chain buffers stay flat.
"""
import torch
import torch.distributed as dist

from ... import compress
from ..job_thread import JobThread
from ..all_gather import Capacity
from .codecs import PartCodecs
from .driver import Driver, stamp, waiter
from .jobs import TensorJob, TensorSegment
from .phased import PhasedExchange
from .tensors import pending_future
from .two_levels import TwoLevelExchange


class Pipeline:
    """The exchange of named parts (see the module's docstring). Made from ``params``
    (CompressionParams), ``reducer`` (its name, as compress.choose_reducer chose it),
    ``optimizer`` and ``named_parameters`` (the codecs' names for checkpoints: codecs.py) and
    ``traffic`` (the comm.metrics.Counters its bytes are added to); ``seed_rank``: codecs.PartCodecs'."""

    def __init__(self, params, reducer, optimizer, named_parameters, traffic, seed_rank=None):
        self.params, self.traffic = params, traffic
        reducer_class = compress.REDUCERS.get(reducer)  # "sum" is no class
        phased = getattr(reducer_class, "phases", 1) > 1  # thc and PowerSGD: each phase one all_reduce
        self.host_first = getattr(reducer_class, "host_first", False)  # thc: two levels sum the host first
        self.codecs = PartCodecs(params, reducer, optimizer, named_parameters, phased, seed_rank)
        # three stages, each one thread taking calls in order: compressing the next call overlaps
        # gathering this one, gathering it overlaps reducing the one before, and one thread
        # issues every collective of the pipeline
        self.compressor = JobThread("bps_gc-comm-hook-compress")
        self.exchanger = JobThread("bps_gc-comm-hook-exchange")
        self.reducing = JobThread("bps_gc-comm-hook-reduce")
        self.two_levels = TwoLevelExchange(params, traffic)
        self.driver = Driver(traffic.add, self.compressor, self.exchanger, self.reducing, self.two_levels)
        self.phased = PhasedExchange(traffic) if phased else None
        self.capacities = {}  # batch index -> its payloads' all_gather.Capacity (the gathering thread's)
        self.side_groups = {}  # the caller's process group -> the pipeline's own group of the same ranks
        self.streams = {}  # CUDA device -> the side stream its buffers are reduced on
        self.destination, self.rank = None, None  # reduce_at's: each part's reducing rank, this one's

    def share_scratch(self, free_after_call=True):
        """From now on (before the first call), every part's codecs (numpy, or device: tensors
        made on the call's stream) share one compress.Scratch: what they hold between calls is
        their state and, unless it is freed after each call (``free_after_call``: FSDP2's
        shards, docs/fsdp.md, at an allocation a call), a buffer per slot and thread the size of
        the largest part (the DDP hook: no allocation a step, docs/ddp_hook.md "Memory").
        ``None``: each codec keeps its own buffers again (the benchmark's reference,
        scripts/ddp_hook_memory.py)."""
        self.codecs.scratch = None if free_after_call is None else compress.Scratch(kept=not free_after_call)

    def keep_saved_reducers(self, names):
        """From now on, a checkpoint whose part was reduced by one of the reducers ``names`` (not
        the exchange's) loads as saved: that part keeps its saved reducer and state, and so
        resumes bit for bit as it ran. The in-host step's exchange (fsdp_inhost.py) sums exactly
        where its checkpoints before 2026-11-30 re-compressed."""
        self.codecs.saved_reducers_kept = tuple(names)

    def reduce_at(self, destination, rank):
        """From now on (before the first call and any checkpoint load), each part is reduced by
        one rank of the group alone: ``destination(name)``, this process being ``rank`` there. A
        reduce-scatter whose rank reads its own chunk alone (fsdp_inhost.py) wants that. Every
        rank compresses every part and sends each payload to that rank alone (one all_to_all:
        collective/all_to_all.py), which receives 1/S of what an all_gather brings; a part it
        reduces itself with the exact sum ("lossless") it does not compress: its values join
        that sum as they are (codecs.PartCodecs.sums_own_exactly). A part
        reduced elsewhere gets no reducer here (none of its state) and its slice of the buffer
        holds no average after a call (its values unspecified). Flat exchanges only: under two
        levels a host's owner reduces for its host-mates. Phased codecs (thc, PowerSGD) all_reduce
        their phases and reduce every part."""
        self.destination, self.rank = destination, rank
        self.codecs.reduced_here = lambda name: destination(name) == rank

    def submit(self, group, batch, lr, comm=None):
        """The average of ``batch.buffer`` over ``group``, written into it: a pending future of
        the buffer. ``lr``: the learning rate error feedback rescales by; ``comm``: the running
        communicator, whose waits watch the heartbeat (None: torch.distributed's own)."""
        buffer = batch.buffer
        levels = self.two_levels.for_group(group, comm)
        if not self.params.compressed:
            if levels is None or buffer.device.type not in ("cpu", "cuda"):
                return self._all_reduce(group, buffer)
            job = self._job(batch, comm, group, group, levels, [], None, ())
            self.exchanger.submit(self.two_levels.all_reduce, job)
            return job.future
        stamp(batch.index, "called")
        state = self.codecs.state_of(batch)
        raw = buffer.numel() * buffer.element_size()
        self.traffic.add(pushed_raw=raw, pulled_raw=raw)
        ctx = {"lr": lr, "step": self.codecs.next_step(state.codecs)}
        if self.phased is not None:
            job = self._job(batch, comm, self.side_group(group), group, levels if self.host_first else None,
                            state.parts, ctx, state.keys)
            self.exchanger.submit(self.phased.run, job)
            return job.future
        levels = None if state.on_device else levels  # device payloads stay flat (as DeviceTensors')
        if levels is not None and self.destination is not None:
            raise RuntimeError("bps_gc exchange: reduce_at takes a flat exchange, and this group reduces through "
                               "two levels (each host's owner reduces a part for its host-mates)")
        job = self._job(batch, comm, group if levels is not None else self.side_group(group), group, levels,
                        state.parts, ctx, state.keys, state.on_device)
        if self.destination is not None:
            if dist.get_rank(group) != self.rank:
                raise RuntimeError(f"bps_gc exchange: reduce_at was told this is rank {self.rank} of the group, "
                                   f"and it is rank {dist.get_rank(group)}")
            job.destinations, job.rank = tuple(self.destination(name) for name in batch.names), self.rank
        self.driver.run(job)
        stamp(batch.index, "returned")
        return job.future

    def _job(self, batch, comm, side, group, levels, parts, ctx, keys, on_device=False):
        """A TensorJob of ``batch`` on ``side`` (the pipeline's own group, or ``group`` itself
        under two levels), averaged over ``group``'s ranks."""
        buffer = batch.buffer
        future, stream = pending_future(self.streams, buffer)
        scratch = self.codecs.scratch
        if scratch is not None and not scratch.kept and parts:  # freed before the caller's callbacks run
            future.add_done_callback(lambda _: scratch.release())
        segment = TensorSegment(parts, ctx, buffer=buffer, fp16=self.params.fp16, on_device=on_device,
                                two_levels=levels is not None, divisor=dist.get_world_size(group), keys=keys)
        # device payloads stay where they are (NCCL for CUDA); host ones go in one all_gather
        # per call once their size is known (all_gather.Capacity)
        capacity = None if on_device else self.capacities.setdefault(batch.index, Capacity())
        return TensorJob([segment], waiter(side, batch.index, comm), side, capacity,
                         buffer.device if on_device else None, levels, batch.index, stream, future=future)

    def side_group(self, group):
        """The pipeline's own process group with ``group``'s ranks: made by the first call,
        which every member makes at the same point (its first batch)."""
        side = self.side_groups.get(group)
        if side is None:
            side = dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)
            self.side_groups[group] = side
        return side

    def idle(self):
        """Once no call is in flight (a DiLoCo exchange may run across steps)."""
        for stage in (self.compressor, self.exchanger, self.reducing):  # in the order jobs flow
            stage.wait_idle(None)

    def _all_reduce(self, group, buffer):
        sent = buffer.to(torch.float16) if self.params.fp16 else buffer
        sent.div_(dist.get_world_size(group))  # first, so float16 does not overflow
        raw, wire = buffer.numel() * buffer.element_size(), sent.numel() * sent.element_size()
        self.traffic.add(pushed_raw=raw, pulled_raw=raw, pushed_wire=wire, pulled_wire=wire)

        def written_back(future):
            if sent is not buffer:
                buffer.copy_(future.value()[0])
            return buffer
        return dist.all_reduce(sent, group=group, async_op=True).get_future().then(written_back)
