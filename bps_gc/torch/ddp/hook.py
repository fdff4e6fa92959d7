"""A DDP communication hook that sends any bps_gc codec's payloads instead of dense buckets.

    ddp_model.register_comm_hook(None, bps_gc.torch.comm_hook({"compressor": "onebit", "ef": "vanilla"}))

``hook(process_group, bucket) -> Future[Tensor]`` returning the bucket's average, as torch's own
hooks. Each gradient of a bucket is its own partition (one onebit scale over a whole bucket
would mix layers), with a codec chain (error feedback, momentum) kept per gradient
(gradient_codecs.GradientCodecs: it stays when DDP regroups its buckets after the first step), seeded by the
bucket index and position where it was first seen, so seeds agree on every rank. Every rank gathers every rank's payloads and runs
the reducer the parameter server would (bps_gc.collective.coded), so the result is the
server's. Without a compressor it is an all_reduce (float16 with ``fp16``). The learning rate
error feedback rescales by is ``optimizer``'s when the hook is called.

It does not hold backward (docs/ddp_hook.md): it returns a pending future at once, and three
threads per hook take the buckets in call order: one compresses, one gathers (the only one
issuing the hook's collectives, on a process group of the hook's own, made at the first call on
every rank), one reduces, decodes and completes the futures. So a bucket's steps never overlap,
every rank issues the same collectives in the same order, and compressing, gathering and
reducing consecutive buckets overlap (CUDA buckets run on a side stream that first waits for the
gradients). An error on these threads (a codec's, a failed peer's) is the future's: DDP raises
it from backward().

Several ranks per host (hook_two_levels.py, docs/local_ranks.md): where the job runs two levels, a
DDP group of every rank reduces through them on the exchanging thread, so the result is the
parameter server's two levels'. Device-chain buckets stay flat. Futures and CUDA side streams:
futures.py; the per-bucket state and a call's job, in named fields: gradient_codecs.py.

CompressionHook is built from parts, each a class with its own constructor, held by name:
``codecs`` (gradient_codecs.GradientCodecs: each gradient's codec, keyed by parameter, and its
checkpoints), ``phased`` (phased_buckets.PhasedBuckets, thc's buckets; None for other codecs) and
``two_levels`` (hook_two_levels.HookTwoLevels). The hook keeps the threads, side groups and streams
they are given, and its own BucketState per bucket index.
"""
import time

import numpy as np
import torch
import torch.distributed as dist

import bps_gc.core as core

from ... import compress
from ...collective.coded import Capacity, PayloadsMissing, compress_parts, exchange_payloads, payload_bytes, reduce_parts
from ...collective.job_thread import JobThread
from ...collective.security import refuse_security_settings
from ..checkpoint import register
from .dtypes import TORCH_OF, wire_dtype, wire_torch
from .futures import current, on_side_stream, raiser, settle, value
from .hook_two_levels import HookTwoLevels
from .phased_buckets import PhasedBuckets
from .gradient_codecs import BucketJob, BucketState, GradientCodecs, key_maker


# Opt-in timeline (scripts/bench_hook.py --timeline): None, or a list that collects
# (bucket index, event, time.perf_counter(), time.thread_time()) of every compressed bucket.
# Off, a stamp costs one global lookup and a None check.
TIMELINE = None


def _stamp(index, event):
    if TIMELINE is not None:
        TIMELINE.append((index, event, time.perf_counter(), time.thread_time()))


class CompressionHook:
    def __init__(self, compression_params=None, reducer=None, optimizer=None, named_parameters=None):
        refuse_security_settings()  # DDP's links take no token: refused, never silently ignored
        self.params = compress.CompressionParams.from_dict(dict(compression_params or {}))
        self.optimizer = optimizer
        self.reducer = compress.choose_reducer(self.params, reducer)  # names both if they misfit
        reducer_class = compress.REDUCERS.get(self.reducer)  # "sum" is no class
        # thc and PowerSGD: each phase one all_reduce (phased_buckets.py)
        phased = getattr(reducer_class, "phases", 1) > 1
        self.buckets = {}  # bucket index -> its BucketState
        self.lr = 0.0  # without an optimizer: the learning rate of the next call (current_lr)
        # the codecs by gradient (gradient_codecs.py), named for checkpoints by ``named_parameters``
        self.codecs = GradientCodecs(self.params, self.reducer, optimizer, named_parameters, phased)
        # three stages, each one thread taking buckets in call order: compressing the next bucket
        # overlaps gathering this one, gathering it overlaps reducing the one before, and one
        # thread issues every collective of the hook
        self.compressor = JobThread("bps_gc-comm-hook-compress")
        self.exchanger = JobThread("bps_gc-comm-hook-exchange")
        self.reducing = JobThread("bps_gc-comm-hook-reduce")
        self.capacities = {}  # bucket index -> its payloads' all_gather.Capacity (the exchanging thread's)
        self.side_groups = {}  # DDP's process group -> the hook's own group of the same ranks
        self.streams = {}  # CUDA device -> the side stream its buckets are reduced on
        self.traffic = core.hook_traffic()  # what bps_gc.core.metrics() reports, with or without init()
        self.two_levels = HookTwoLevels(self.params, self.traffic, self.waiter)  # several ranks per host
        self.phased = PhasedBuckets(self.codecs, self.current_lr, self.exchanger, self.traffic, self.pending_future,
                                    self.side_group, self.waiter, getattr(reducer_class, "host_first", False)) \
            if phased else None

    def __call__(self, process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        levels = self.two_levels.for_group(group)
        if not self.params.compressed:
            if levels is None or buffer.device.type not in ("cpu", "cuda"):
                return self._all_reduce(group, buffer)
            future, stream = self.pending_future(buffer)
            self.exchanger.submit(lambda: self.two_levels.all_reduce(levels, group, bucket.index(), buffer,
                                                                     future, stream))
            return future.then(value)
        if self.phased is not None:
            return self.phased.call(group, bucket, buffer, levels)
        index, sizes = bucket.index(), [g.numel() for g in bucket.gradients()]
        _stamp(index, "called")
        state = self._state(index, sizes, buffer, self.codecs.gradient_ids(bucket, index, len(sizes)),
                            key_maker(bucket, index))
        on_device = state.on_device
        ctx = {"lr": self.current_lr(), "step": self.codecs.next_step(state.codecs)}
        levels = None if on_device else levels  # device payloads stay flat (as DeviceTensors')
        side = group if levels is not None else self.side_group(group)
        job = BucketJob(side, index, buffer, state.parts, ctx, on_device, levels,
                        tuple(codec.key for codec in state.codecs))
        future, stream = self.pending_future(buffer)
        self.compressor.submit(lambda: self._compress_stage(job, future, stream))
        _stamp(index, "returned")
        # DDP reads a failed Python future's exception as its value ("Unable to cast ... to
        # Tensor"); a callback that raises it marks the chained future failed, with the
        # exception's type and text in the error DDP raises
        return future.then(value)

    def pending_future(self, buffer):
        """(the bucket's pending future, its CUDA side stream and event or None)."""
        if buffer.device.type == "cpu":
            return torch.futures.Future(), None
        return on_side_stream(self.streams, buffer)

    def _compress_stage(self, job, future, stream):
        """On the compressing thread: the bucket's payloads (None and the error if compressing
        failed), handed on to the exchanging thread in the same order."""
        index, buffer, parts, ctx, on_device = job.index, job.buffer, job.parts, job.ctx, job.on_device
        _stamp(index, "compress start")
        with current(stream):
            try:
                if stream is not None:
                    stream[0].wait_event(stream[1])
                if job.levels is not None:  # its owners compress the host's sums, on the exchanging thread
                    # float32 (float64 for a float64 bucket) on CPU: a view
                    grad, payloads = buffer.detach().to("cpu", wire_torch(buffer, False)), None
                else:
                    grad = buffer.detach().to(wire_torch(buffer, self.params.fp16))  # its own dtype: a view
                    payloads = compress_parts(parts, grad if on_device else grad.cpu().numpy(), ctx)
                    self.traffic.add(pushed_wire=payload_bytes(payloads))
                raw = buffer.numel() * buffer.element_size()
                self.traffic.add(pushed_raw=raw, pulled_raw=raw)
                failure = None
            except Exception as e:  # the others still gather (and learn that this rank failed)
                grad, payloads, failure = None, None, e
        _stamp(index, "compress end")
        self.exchanger.submit(lambda: self._gather_stage(job, future, stream, grad, payloads, failure))

    def _gather_stage(self, job, future, stream, grad, payloads, failure):
        """On the exchanging thread (the only one issuing the hook's collectives): every rank's
        payloads of the bucket (or the error), handed to the reducing thread in the same order,
        so the next bucket's gather overlaps this one's reduction. A two-level bucket is
        reduced here, where its collectives are."""
        index = job.index
        _stamp(index, "exchange start")
        with current(stream):
            try:
                if job.levels is not None:
                    if failure is not None:  # the host's other ranks stop at this rank's exit (their waits name it)
                        raise RuntimeError(f"bps_gc comm_hook: DDP bucket {index}: {type(failure).__name__}: {failure}")
                    result = self.two_levels.exchange(job, grad)
                    finish = lambda: result  # noqa: E731
                else:
                    gathered = self._gather(job, payloads, failure)
                    finish = lambda: self._reduce(job, grad, gathered)  # noqa: E731
            except BaseException as e:  # noqa: B036 (the bucket's future is its way out)
                finish = raiser(e)
        _stamp(index, "exchange end")
        self.reducing.submit(lambda: self._reduce_stage(job, future, stream, finish))

    def _reduce_stage(self, job, future, stream, finish):
        _stamp(job.index, "reduce start")

        def done():
            result = finish()
            _stamp(job.index, "completed")  # before the future's result: DDP may go on to the next step
            return result
        with current(stream):
            settle(future, done)

    def _gather(self, job, payloads, failure):
        """Every rank's payloads of the bucket, in rank order; a rank that could not make its
        own names itself (or the others stop too, naming it)."""
        group, index, buffer, parts = job.group, job.index, job.buffer, job.parts
        wait = self.waiter(group, index)
        start = time.perf_counter()
        try:
            # device payloads stay where they are (NCCL for CUDA); host ones go in one all_gather
            # per bucket once their size is known (all_gather.Capacity)
            capacity = None if job.on_device else self.capacities.setdefault(index, Capacity())
            gathered = exchange_payloads(payloads, wait, group, len(parts), capacity,
                                         buffer.device if job.on_device else None)
            received = payload_bytes(p for rank in gathered for p in rank) - payload_bytes(payloads)
            self.traffic.add(pulled_wire=received, communicate_seconds=time.perf_counter() - start)
            return gathered
        except PayloadsMissing as missing:
            if failure is not None:
                raise RuntimeError(f"bps_gc comm_hook: compressing DDP bucket {index} failed: "
                                   f"{type(failure).__name__}: {failure}") from failure
            raise RuntimeError(f"bps_gc comm_hook: DDP bucket {index}: {missing} (their errors name "
                               "the cause); this rank stops too") from None

    def _reduce(self, job, grad, gathered):
        """On the reducing thread: run the reducer on every gradient's payloads and decode its
        reply, averaged, into the bucket's buffer."""
        index, buffer, parts, ctx = job.index, job.buffer, job.parts, job.ctx
        size = dist.get_world_size(job.group)
        if job.on_device:
            result = reduce_parts(parts, gathered, torch.empty_like(grad), ctx, size)
        else:
            # decoded straight into the buffer where it holds the wire dtype (the compressing
            # thread is done with it); else into a host array, then copied
            wire = wire_dtype(buffer, self.params.fp16)
            direct = buffer.device.type == "cpu" and buffer.is_contiguous() and buffer.dtype == TORCH_OF[wire]
            total = reduce_parts(parts, gathered, buffer.detach().numpy() if direct else np.empty(grad.numel(), wire),
                                 ctx, size)
            result = None if direct else torch.from_numpy(total)
        _stamp(index, "reduced")
        if result is not None:
            buffer.copy_(result)
        return buffer

    def waiter(self, group, index):
        """How the worker waits for a collective: through bps_gc's collective communicator when
        it runs (its heartbeat names a dead or departed rank within its bound, as a
        NodeFailure), else gloo's own wait, whose error (a peer's socket closed) becomes one."""
        comm = core.communicator() if core.is_initialized() else None
        if comm is not None and comm.watches_works:
            def through(work, what):
                comm.wait(work, lambda: f"{what} of DDP bucket {index}")
        else:
            def through(work, what):
                try:
                    work.wait()
                except RuntimeError as e:
                    raise core.NodeFailure(f"bps_gc: {what} of DDP bucket {index} failed on rank "
                                           f"{dist.get_rank()}: {e}") from None

        def wait(work, what):
            _stamp(index, what + " start")
            through(work, what)
            _stamp(index, what + " end")
        return wait

    def side_group(self, group):
        """The hook's own process group with ``group``'s ranks: made by the first call, which
        every member makes at the same point (its first bucket)."""
        side = self.side_groups.get(group)
        if side is None:
            side = dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)
            self.side_groups[group] = side
        return side

    def current_lr(self):
        """The learning rate error feedback rescales by: the optimizer's now, else ``lr`` (set
        by the caller of a named exchange, torch/exchange.py)."""
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else float(self.lr)

    def _state(self, index, sizes, buffer, gradients, key_of):
        """The BucketState of bucket ``index``, from the codecs of its gradients (their ids
        ``gradients``: gradient_codecs.py keeps each one's codec across DDP's regrouping): device
        chains and reducers on the bucket's device when ``uses_device_chain``
        (BPS_GC_DEVICE_CODECS: by default for buckets off the CPU), else numpy ones."""
        state = self.buckets.get(index)
        if (state is None or state.sizes != sizes or (state.device, state.dtype) != (buffer.device, buffer.dtype)
                or state.gradients != gradients):
            codecs, on_device = self.codecs.codecs_for(index, gradients, sizes, buffer, key_of)
            state = BucketState(sizes, buffer.device, buffer.dtype, codecs, on_device, gradients)
            self.buckets[index] = state
        return state

    def codec_state(self):
        """A Stateful of every gradient's codec, by parameter name (bps_gc/torch/checkpoint.py),
        once no call is in flight (a DiLoCo exchange may run across steps)."""
        for stage in (self.compressor, self.exchanger, self.reducing):  # in the order jobs flow
            stage.wait_idle(None)
        return self.codecs.codec_state()

    def codec_state_to_load(self, sd):
        """(the fresh codecs ``sd`` loads into, a function installing them once loaded):
        GradientCodecs', whose install also forgets the buckets, rebuilt from the installed
        codecs at the next call."""
        fresh, install = self.codecs.codec_state_to_load(sd)

        def install_and_forget():
            install()
            self.buckets.clear()
            if self.phased is not None:
                self.phased.forget()
        return fresh, install_and_forget

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


def comm_hook(compression_params=None, reducer=None, optimizer=None, named_parameters=None):
    """A hook for ``DistributedDataParallel.register_comm_hook(process_group_or_None, hook)``;
    a plain function (DDP logs and checks hooks by their function name), its per-gradient codec
    state in ``hook.compression``, saved by bps_gc.torch.state_dict() under the names of
    ``named_parameters`` (model.named_parameters(); else ``optimizer``'s parameter order)."""
    compression = register(CompressionHook(compression_params, reducer, optimizer, named_parameters), "comm_hook")

    def bps_gc_comm_hook(process_group, bucket):
        return compression(process_group, bucket)
    bps_gc_comm_hook.compression = compression
    return bps_gc_comm_hook
