"""The compressed exchange's driver: the one place where "compress -> gather -> reduce, decode,
divide, deliver" is sequenced, for every caller on torch.distributed (the pipeline's calls:
pipeline.py, on three threads; the collective's buckets: collective/buckets.py, inline on its
exchange thread). The stages themselves are coded.py's.

    compress_stage  each segment of the job not yet compressed -> its payloads (or its error)
    gather_stage    every rank's payloads in one all_gather on the job's group, or each to the
                    rank that reduces it in one all_to_all (a job with ``destinations``; a
                    two-level job: reduced whole through the levels here, where its collectives are)
    reduce_stage    each segment's reducers over every rank's payloads, decoded into its target,
                    divided, delivered; the job settled (its future, or its errors raised)

Each stage runs on its runner (a job_thread.JobThread, or ``Inline``), taking jobs in order, and
hands the job on: ``runner.submit(stage, job)``. So with three threads a job's steps never
overlap while consecutive jobs' do; every rank issues the same collectives in the same order
from one gathering thread. An error of a stage is the job's: every rank still takes part in the
gather (all_gather.py), and the job ends with it.
"""
import time

import torch.distributed as dist

from ...comm import NodeFailure
from ..coded import PayloadsMissing, compress_parts, exchange_payloads, payload_bytes, reduce_parts
from .tensors import current

# Opt-in timeline (scripts/bench_hook.py --timeline): None, or a list that collects
# (job index, event, time.perf_counter(), time.thread_time()) of every pipeline job.
# Off, a stamp costs one global lookup and a None check.
TIMELINE = None


def stamp(index, event):
    if TIMELINE is not None and index is not None:  # a job without an index (a step inside another) is not traced
        TIMELINE.append((index, event, time.perf_counter(), time.thread_time()))


def waiter(group, index, comm):
    """How the pipeline waits for a collective (None: one this rank skips): through bps_gc's
    collective communicator ``comm`` when it runs (its heartbeat names a dead or departed
    rank within its bound, as a NodeFailure), else gloo's own wait, whose error (a peer's
    socket closed) becomes one. The communicator counts each collective on ``group`` (one
    skipped counts too, as the others issue it), so a member that left names itself at once."""
    watched = comm is not None and comm.watches_works
    if watched:
        def through(work, what):
            comm.wait(comm.issue(work, group), lambda: f"{what} of DDP bucket {index}", group=group)
    else:
        def through(work, what):
            try:
                work.wait()
            except RuntimeError as e:
                raise NodeFailure(f"bps_gc: {what} of DDP bucket {index} failed on rank "
                                  f"{dist.get_rank()}: {e}") from None

    def wait(work, what):
        if work is None:
            if watched:
                comm.issue(None, group)
            return
        stamp(index, what + " start")
        through(work, what)
        stamp(index, what + " end")
    return wait


class Inline:
    """A runner that runs each stage at once on the caller's thread (the collective's exchange
    thread, which already takes its buckets in order)."""

    @staticmethod
    def submit(stage, job):
        stage(job)


class Driver:
    """``run(job)``: the job through the three stages, each on its runner (``compressing``,
    ``gathering``, ``reducing``). ``count(**amounts)`` adds to the traffic counters
    (comm.metrics' fields); ``two_levels`` reduces a job with ``levels`` (two_levels.py)."""

    def __init__(self, count, compressing, gathering, reducing, two_levels=None):
        self.count, self.two_levels = count, two_levels
        self.compressing, self.gathering, self.reducing = compressing, gathering, reducing

    def run(self, job):
        self.compressing.submit(self.compress_stage, job)

    def compress_stage(self, job):
        stamp(job.index, "compress start")
        with current(job.stream):
            for segment in job.segments:
                if not segment.compressed:  # the collective compresses a tensor as it is added
                    self.compress(segment, job)
        stamp(job.index, "compress end")
        self.gathering.submit(self.gather_stage, job)

    def compress(self, segment, job=None):
        """This rank's payloads of ``segment`` (or the error that stopped them: the others still
        gather, and learn that this rank failed). Counted as pushed: all of them, or with
        ``job.destinations`` those that leave this rank (a one-segment job). ``job``: None where
        the collective compresses a tensor as it is added (buckets.py), before its job exists."""
        start = time.perf_counter()
        stream, destinations = (None, None) if job is None else (job.stream, job.destinations)
        try:
            if stream is not None:
                stream.wait_for_backward()
            if self.encode(segment) is None:  # two levels: its owners compress the host's sums
                return
        except Exception as e:  # noqa: BLE001 -- the job's error, raised when it ends
            segment.failure = e
            return
        sent = segment.payloads if destinations is None else \
            [p for p, to in zip(segment.payloads, destinations) if to != job.rank]
        self.count(compress_seconds=time.perf_counter() - start, pushed_wire=payload_bytes(sent))

    @staticmethod
    def encode(segment):
        """The compress stage's work: this rank's payloads of ``segment``, its errors raised
        (None where its parts are not compressed here). push_pull through device chains
        (torch/device.py) runs it on the caller's thread, its gather the communicator's."""
        flat = segment.load()
        if flat is not None:
            segment.payloads = compress_parts(segment.parts, flat, segment.ctx)
        return segment.payloads

    def gather_stage(self, job):
        stamp(job.index, "exchange start")
        with current(job.stream):
            try:
                if job.levels is not None:
                    self.two_levels.exchange(job)
                else:
                    job.gathered = self.gather(job)
            except BaseException as e:  # noqa: B036 (the job's end raises it)
                job.error = e
        stamp(job.index, "exchange end")
        self.reducing.submit(self.reduce_stage, job)

    def gather(self, job):
        """Every rank's payloads of the job's segments, in rank order (with ``job.destinations``,
        None where a part is reduced by another rank)."""
        failure = next((s.failure for s in job.segments if s.failure is not None), None)
        mine = None if failure is not None else [p for s in job.segments for p in s.payloads]
        start = time.perf_counter()
        if job.skipped is not None:  # nothing crosses: every rank counts the all_gather's two collectives alike
            if failure is not None:
                raise failure
            job.wait(None, job.skipped)
            job.wait(None, job.skipped)
            self.count(pulled_wire=0, communicate_seconds=time.perf_counter() - start)
            return [mine]
        try:
            gathered = exchange_payloads(mine, job.wait, job.group, sum(len(s.parts) for s in job.segments),
                                         job.capacity, job.device, job.destinations)
        except PayloadsMissing as missing:
            job.payloads_missing(missing, failure)
        if job.destinations is None:
            received = payload_bytes(p for rank in gathered for p in rank) - payload_bytes(mine)
        else:  # the others' payloads of the parts reduced here
            received = payload_bytes(p for r, rank in enumerate(gathered) if r != job.rank for p in rank)
        self.count(pulled_wire=received, communicate_seconds=time.perf_counter() - start)
        return gathered

    def reduce_stage(self, job):
        stamp(job.index, "reduce start")
        with current(job.stream):
            job.settle(self.reduce)  # the job's result is self.reduce(job), or its error

    def reduce(self, job):
        """Each segment's reducers over every rank's payloads, decoded, divided and delivered."""
        if job.error is not None:
            raise job.error
        if job.levels is None:
            offset = 0
            for segment in job.segments:
                count = len(segment.parts)
                self.reduce_segment(segment, [rank[offset:offset + count] for rank in job.gathered])
                offset += count
            stamp(job.index, "reduced")
        stamp(job.index, "completed")  # before the future's result: DDP may go on to the next step
        return job.result()

    @staticmethod
    def reduce_segment(segment, gathered):
        """The reduce stage's work on one segment: each part's reducer over every rank's payloads
        (``gathered``: per rank, a payload per part), decoded into its target, divided, delivered.
        A segment reduced elsewhere (no target: device payloads, reduced by push_pull on its own
        thread, which calls this with the payloads handed to it) is handed ``gathered``."""
        target, divisor = segment.target()
        if target is None:
            segment.deliver(gathered)
            return
        reduce_parts(segment.parts, gathered, target, segment.ctx, divisor)
        segment.deliver(target)
