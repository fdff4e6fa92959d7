"""``Collective``: the communicator (comm/communicator.py) on torch.distributed.

Reductions are fused into buckets like DDP's (BPS_GC_BUCKET_BYTES, 25 MB of input): a bucket
goes out when full or when any handle is waited for. Going out hands it to the
exchange thread (job_thread.py), so reduce() returns at once: a gradient hook never holds
backward for an exchange. There its dense tensors are summed by one all_reduce (per dtype), its
two-phase tensors' phases by one all_reduce each, and its compressed tensors, cut into the
parameter server's partitions (same keys, so the same codec seeds) and compressed there, send
their payloads in one all_gather, and every rank runs the server's reduction (coded.py); the
handles' wait() delivers the results. Every rank issues the same collectives in the same order
because every rank declares, reduces and waits in the same order (the contract of the
interface), the thread takes buckets in the order they were flushed, and the collectives the
caller issues itself wait until the thread is idle (``drain``). A bucket's error (a codec's, a
failed peer's) is raised by every wait on its handles.

Every wait polls the heartbeat (lifecycle.py). ``all_reduce`` is the plain-sum phase
PowerSGD's P and Q steps call.

This file holds the interface's calls (declare, reduce, the plain collectives); its parts, each
made with what it needs and holding no other part's state, the rest: ``lifecycle``
(lifecycle.py: start, shutdown, waits, ``issue``), ``buckets`` (buckets.py: fusing and
exchanging reductions), ``phases`` (reductions.py: two-phase and majority), ``two_levels``
(two_level_reductions.py), ``messages`` (messages.py), ``device`` (device_tensors.py),
``checkpoint`` (checkpoint_state.py). A part calls another only through its public methods,
handed to it at construction (``Buckets.exchanges`` takes the other parts' exchanges by name).
What they share (the counters, the failure, the heartbeat, the levels, the counts of
collectives and messages) is one ``shared.Shared``.
"""
import time

import numpy as np
import torch
import torch.distributed as dist

from ..comm import communicator as api
from ..comm.metrics import Metrics
from ..comm.phased import host_first, phases
from ..comm.placement import Placement, check_dtype
from .buckets import Buckets, Handle
from .device_tensors import DeviceTensors
from .job_thread import JobThread
from .lifecycle import Lifecycle
from .messages import Messages
from .reductions import PhasesAndVotes
from .shared import Shared
from .checkpoint_state import CommunicatorState
from .two_level_reductions import TwoLevelReductions


class Collective(api.Communicator):
    gathers_payloads = True  # every rank reduces every rank's payloads, as a server would
    watches_works = sums_tensors_on_device = reduces_on_process_groups = True

    @property
    def why_no_job_after_shutdown(self):
        """A default process group of the script's (adopted) outlives shutdown, and another job
        adopts it again; bps_gc's own group leaves its rendezvous port bound in this process."""
        if self.lifecycle.adopted:
            return None
        return ("the process group init() made keeps its rendezvous port bound in this process: start the next "
                "job in a new process, or make the default process group in the script (each init() adopts it)")

    def __init__(self, cfg, codecs, local_rank=None, local_size=None):
        self.cfg, self.codecs = cfg, codecs
        self.rank, self.size = cfg.rank, cfg.size
        self.local_rank = cfg.local_rank if local_rank is None else local_rank
        self.local_size = cfg.local_size if local_size is None else local_size
        self.tensors = {}
        self.placement = Placement(1, cfg.partition_bytes, cfg.min_compress_bytes)
        self.shared = Shared(self.rank, self.size)
        self.exchanger = JobThread(f"bps_gc-collective-exchange-{self.rank}")
        self.lifecycle = Lifecycle(cfg, self.shared, self.exchanger, self.local_size)
        self.two_levels = TwoLevelReductions(cfg, self.shared, self.lifecycle, self.local_rank, self.local_size)
        self.buckets = Buckets(self.shared, self.lifecycle, self.exchanger, cfg.bucket_bytes)
        self.phases = PhasesAndVotes(self.shared, self.lifecycle, self.buckets, self._sum)
        self.messages = Messages(self.shared, self.lifecycle)
        self.device = DeviceTensors(self.shared, self.lifecycle, self.buckets, self.tensors, self.partitions)
        self.buckets.exchanges(coded_on_hosts=self.two_levels.exchange_coded_on_hosts,
                               phased=self.phases.exchange_phased,
                               deliver_tensors=self.device.deliver_tensors)
        # the calls other layers make straight to a part: bound here, so a call costs no more
        # than it did (check_alive, wait, issue and flush: collective/exchange/, tests; the device calls:
        # torch/device.py, torch/ops.py)
        self.check_alive, self.wait, self.drain = self.lifecycle.check_alive, self.lifecycle.wait, self.lifecycle.drain
        self.issue = self.lifecycle.issue  # the pipeline's collectives, counted per group (exchange/driver.py)
        self.flush = self.buckets.flush
        self.push_payloads, self.reduce_tensor = self.device.push_payloads, self.device.reduce_tensor
        self.checkpoint = CommunicatorState(codecs, self.tensors, self.rank, self.flush, self.drain)
        self.state_dict, self.load_state_dict = self.checkpoint.state_dict, self.checkpoint.load_state_dict

    # ------------------------------------------------------------------ lifecycle

    def start(self):
        self.lifecycle.start(self.two_levels.join_levels, self.barrier)
        return self

    def shutdown(self, timeout=10.0):
        self.lifecycle.shutdown(timeout, self.buckets.flush)

    def abandon(self, reason):
        self.lifecycle.abandon(reason)

    def peer_failure(self, error):
        return self.lifecycle.peer_failure(error)

    @property
    def levels(self):
        """levels.HostLevels when two levels run (after start), else None."""
        return self.shared.levels

    # ------------------------------------------------------------------ tensors

    def _place(self, tensor, shape, dtype, late):
        """Balanced by bytes, declared or placed late: every rank runs the server's reducer
        (``_build_codec``), so no server's load depends on it."""
        check_dtype(tensor, dtype)
        self.placement.plan(tensor, shape, dtype, self._build_codec, balanced=True)

    def reduce(self, array, name, average=True, priority=0, ctx=None, out=None, lr=None):
        """Sum (or average) over all ranks into ``out`` (default: ``array``, in place)."""
        tensor, array, out, ctx = self._open_reduce(array, name, ctx, out, lr)
        # dense: the bucket's concatenation is the one copy, made when the bucket goes out (like
        # the parameter server's push, the caller leaves the array alone until wait());
        # compressed: a copy the reduction then overwrites with the result
        # two levels sum a host in the tensor's dtype, then cast the host's sum for the wire (as
        # the parameter server's do); PowerSGD's phases start from each rank's own wire copy
        # (with two levels every source is copied into the host's shared memory before any result
        # is written, so a compressed tensor needs no copy of its own there either)
        levels, buckets, counters = self.shared.levels, self.buckets, self.shared.counters
        # thc's phases cross hosts between the host's sums too (two_level_reductions.py), PowerSGD's do not
        two_levels = levels is not None and (phases(tensor) == 1 or host_first(tensor))
        carried = tensor.dtype if two_levels else tensor.wire_dtype
        # dense in place: ``out`` is the array (contiguous: resolve_reduce_call), ``wire`` a view of it
        in_place = out is array and not tensor.compressed and array.dtype == carried
        wire = array.reshape(-1) if in_place else \
            np.ascontiguousarray(array).reshape(-1).astype(carried, copy=tensor.compressed and not two_levels)
        counters.pushed_raw += wire.nbytes
        counters.pulled_raw += wire.nbytes
        if two_levels:  # dense or not (two_level_reductions.py)
            return buckets.add_on_hosts(tensor, wire, out, average, ctx)
        if not tensor.compressed:
            return buckets.add_dense(tensor.name, wire, out, average, in_place)
        if phases(tensor) > 1:
            return self.phases.add_phased(tensor, wire, out, average, ctx)
        if tensor.reducer != "majority":
            return buckets.add_coded(tensor, wire, out, average, ctx)
        start = time.perf_counter()
        self.phases.vote_signs(tensor, wire, ctx)
        counters.communicate_seconds += time.perf_counter() - start
        buckets.deliver(wire, out, False)  # a vote: never averaged
        return Handle(buckets, out)

    push_pull = reduce  # BytePS's name (comm/communicator.py), bound here: one call fewer a tensor

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, array, average=False):
        """A plain in-place sum over ranks now (PowerSGD's P and Q phases, local SGD's model
        difference); no codec, no bucket."""
        self.check_alive()
        self.drain()
        return self._sum(array, average)

    def _sum(self, array, average=False):
        """``all_reduce`` on the thread that runs it (the exchange thread for a bucket's phases)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.shared.levels is not None:
            self.shared.levels.all_reduce(tensor.numpy())
        else:
            self.wait(self.lifecycle.issue(dist.all_reduce(tensor, async_op=True)), "all_reduce")
        if average:
            tensor /= self.size
        if not np.shares_memory(tensor.numpy(), array):
            np.copyto(array, tensor.numpy())
        return array

    def barrier(self):
        self.check_alive()
        self.flush()
        self.drain()
        self.wait(self.lifecycle.issue(dist.barrier(async_op=True)), "barrier")

    def broadcast(self, array, root_rank, name):
        if not 0 <= root_rank < self.size:
            raise ValueError(f"broadcast: root_rank {root_rank} outside [0, {self.size})")
        self.check_alive()
        self.drain()
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        self.wait(self.lifecycle.issue(dist.broadcast(tensor, root_rank, async_op=True)), f"broadcast of {name!r}")
        if not np.shares_memory(tensor.numpy(), array):
            np.copyto(array, tensor.numpy())
        return array

    def send(self, rank, name, payload):
        self.drain()
        return self.messages.send(rank, name, payload)

    def recv(self, rank, name, timeout=None):
        self.drain()
        return self.messages.recv(rank, name, timeout)

    def metrics(self):
        current, self.shared.counters = self.shared.counters, Metrics()
        return current
