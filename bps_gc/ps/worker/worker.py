"""The worker core, the parameter-server Communicator: numpy in, numpy out, no framework.

Each worker process (one per local rank) joins the cluster. With several local ranks per host
(two levels, ps/worker/host.py) a host's ranks sum in shared memory and the servers sum one
push per host; with BPS_GC_HIERARCHY=flat every rank pushes its own tensors. With
one worker process and BYTEPS_FORCE_DISTRIBUTED unset, nothing leaves the process.
"""
import concurrent.futures
import functools
import logging
import threading

import numpy as np
import zmq

from ...comm.communicator import PEER_GONE, Communicator
from ...comm.metrics import Counters
from ...comm.phased import PhasedReduction, host_first, phase_dtype, phase_lengths, phase_names, phases
from ...comm.placement import Placement, check_dtype, declare_tensor, dense_partition_bytes
from ...wire.sockets import Auth
from ...wire.half import HALF_SUMS, SERVER_MEAN
from ...wire.wire import encode_context
from ..membership.membership import Membership, phase_words
from . import codec_state
from . import host as host_level
from .commands import Barrier, Goodbye, InitKey, SendPush, StartLocal
from .compressing import CompressedPushes
from .elastic import ElasticRounds
from .handle import Handle, servers_average
from .io import WorkerIO
from .lone_worker import LoneWorker
from .payloads import push_payloads
from .peers import Peers
from .push import Push

log = logging.getLogger("bps_gc.worker")


class Worker(Communicator):
    """``codecs`` is the codec library (``bps_gc.compress``: CompressionParams, build_chain,
    choose_reducer, make_reducer, step_context); the parameter server never imports it."""
    pushes_one_per_host = True

    def __init__(self, cfg, codecs):
        self.cfg, self.codecs = cfg, codecs
        self.rank, self.size = cfg.rank, cfg.size
        self.local_rank, self.local_size = cfg.local_rank, cfg.local_size
        self.tensors = {}
        self.counters = Counters()
        self.peers = None  # worker-to-worker links (ps.worker.peers), made at start()
        self.local = None  # the shared-memory sums of a one-host job (ps.worker.local)
        self.host = None  # two levels: this host's ranks sum first, push once (ps.worker.host.HostShares)
        self.host_memory = None  # the shared-memory sums (ps.worker.local), of either
        self.io = None
        self.compressed_pushes = None  # compressing.py: the codec pool's way to the I/O thread
        self.pool = None
        self.placement = None
        self.closed = False
        self.alone = None  # lone_worker.py: one process that never reaches the servers
        self.elastic = None  # BPS_GC_ELASTIC: whole round groups (elastic.py)
        self.phase_words = None  # what the servers sum thc's phase words in (``phase_words``)
        self.epoch = 0  # BPS_GC_ELASTIC: the membership epoch of the last round group released
        self.members = list(range(self.size))  # BPS_GC_ELASTIC: its members' ranks, in order
        self.joining = False  # BPS_GC_ELASTIC: this worker joins a running job (joining.py)

    # ------------------------------------------------------------------ lifecycle

    # a lone worker's process may train again; a job of roles has ended for good
    why_no_job_after_shutdown = property(lambda self: None if self.alone else Communicator.why_no_job_after_shutdown)

    def start(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(self.cfg.threadpool_size, "bps_gc-codec")
        if not self.cfg.distributed and self.size == 1:
            self.alone = LoneWorker(self.cfg)  # says so; ends a scheduler and servers started for it
            self.peers = Peers(None, self.cfg, None, self.rank, self.size, None, log)
            return self
        self.ctx = zmq.Context()
        self.auth = Auth(self.ctx, self.cfg.auth_token, self.cfg.encrypt)
        self.membership = Membership(self.ctx, self.cfg, self.auth, "worker", rank=self.rank)
        # bound before the join: its address travels in REGISTER into the address book
        self.peers = Peers(self.ctx, self.cfg, self.auth, self.rank, self.size, self.membership.host, log)
        self.membership.port = self.peers.port
        # its unix socket travels in REGISTER too
        local = host_level.open_local(self, self.membership.host, self.peers.port)
        if local is not None:
            self.membership.local = local.endpoint
        book = self.membership.join(self.cfg.join_timeout)
        servers = book["servers"]
        self.phase_words = phase_words(servers)
        self.sums_half = all(HALF_SUMS in (s.get("sums") or ()) for s in servers)
        self.peers.connect(book["workers"], lambda: self.io.failure if self.io else None, self.membership.left)
        local, self.host = host_level.connect(self.cfg, self.size, local, book, self.membership.host,
                                              self.membership)
        self.local = None if self.host is not None else local
        self.host_memory = local
        self.io = WorkerIO(self.ctx, self.cfg, self.auth, self.membership, servers, self.rank,
                           self.cfg.inflight_bytes, self.counters, local)
        if self.cfg.elastic:
            self.elastic = ElasticRounds(self, self.io.links, self.membership)
            self.io.elastic(self.elastic)
        self.compressed_pushes = CompressedPushes(self.pool, self.counters, self.io)
        if self.host is not None:
            self.host.attach(self.io, self.counters, self.compressed_pushes, self.run_phases,
                             functools.partial(Handle, self), self.phase_words)
        self.placement = Placement(len(servers), self.cfg.partition_bytes, self.cfg.min_compress_bytes,
                                   dense_partition_bytes(self.cfg, book))
        self.io.thread.start()
        self.joining = bool(book.get("joining"))
        if not self.joining:  # a joiner is no member yet: the members' barriers are not its
            self.barrier()
        log.info("worker %d/%d joined (%d servers)", self.rank, self.size, len(servers))
        return self

    def shutdown(self, timeout=10.0):
        if self.closed:
            return
        self.closed = True
        if self.io is not None:
            if self.io.failure is None and not self.io.done.is_set():
                self.io.post(Goodbye(timeout))
                self.io.done.wait(timeout + 1)
            self.io.close()
            self.peers.close()
            self.membership.close()
            self.auth.stop()
            self.ctx.term()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.alone is not None:
            self.alone.close()

    def check_alive(self):
        if self.closed:
            raise RuntimeError("bps_gc: the worker was shut down")
        if self.io is not None and self.io.failure is not None:
            raise self.io.failure

    def peer_failure(self, error):
        """A gloo socket error of a collective issued beside bps_gc (FSDP2's, on the host's
        group: bps_gc.torch.host_mesh): the failure the scheduler names (a host-mate that died:
        twice its heartbeat's bound to say so), or None (the script's own error)."""
        if self.io is None or not (isinstance(error, RuntimeError) and PEER_GONE.search(str(error))):
            return None
        bound = 2 * (self.cfg.heartbeat_timeout + self.cfg.heartbeat_interval)
        return self.io.failure_within(bound, self.cfg.heartbeat_interval / 4)

    # ------------------------------------------------------------------ tensors

    def _place(self, tensor, shape, dtype, late):
        """Declared with a shape: balanced over the servers by bytes; placed at its first
        push_pull (``late``): by key, round-robin (the servers' loads are no longer known alike)."""
        # a host's sum in shared memory adds in numpy, which has no bfloat16
        check_dtype(tensor, dtype, self.local is None and (self.host is None or not self.host.carries(tensor)))
        balanced = not late
        if self.placement is None:  # not distributed: nothing to place
            tensor.shape, tensor.dtype = tuple(shape), dtype
            return
        self.placement.plan(tensor, shape, dtype, self._build_codec, balanced)
        if phases(tensor) > 1:  # summed phase by phase in buffers of their own; the servers
            if self.cfg.elastic:  # a phase waits for the last one's sum: no whole round group
                raise ValueError(f"{tensor.name!r}: reducer {tensor.reducer!r} sums in phases, which "
                                 "BPS_GC_ELASTIC does not cover yet (docs/elastic.md); choose another")
            if self.cfg.enable_async:  # never see it
                raise ValueError(f"{tensor.name!r}: reducer {tensor.reducer!r} needs each phase's "
                                 "sum of this round, but BYTEPS_ENABLE_ASYNC servers answer with a "
                                 "running sum; unset it or choose another compressor")
            if self.host is not None and host_first(tensor) and tensor.pushed_by is None:
                named = self.host.phase_tensors(tensor)  # thc: its owners' own phase tensors
            else:
                named = zip(phase_names(tensor), phase_lengths(tensor, self.averaged_over(tensor),
                                                               self.phase_words))
            for name, length in named:
                self._declare_phase(name, length, phase_dtype(tensor), tensor.pushed_by)
            return
        if tensor.pushed_by is not None:  # this local rank's own: the servers count one push per host
            inits = [InitKey.of(tensor, part, pushers="host") for part in tensor.partitions]
        elif self.local is not None and not tensor.compressed and tensor.wire_dtype == tensor.dtype:
            tensor.local = True  # the workers sum it: no server hears of it
            return
        else:
            inits = [InitKey.of(tensor, part) for part in tensor.partitions] \
                if self.host is None else self.host.place(tensor)
        for init in inits:
            self.io.post_declaration(init)

    def _declare_phase(self, name, length, dtype, pushed_by=None):
        """A phase buffer's dense tensor: auxiliary (no raw bytes of its own), and int64 where
        thc's words are (``phase_words``), which a user's tensor may not be; pushed as its
        tensor is (``pushed_by``)."""
        phase, shape, dtype = declare_tensor(self.tensors, self.codecs, name, (length,), dtype, None, {},
                                             pushed_by)
        phase.auxiliary = True
        if shape is not None:
            self._place(phase, shape, dtype, late=False)

    def reduce(self, array, name, average=True, priority=0, ctx=None, out=None, lr=None):
        """Sum (or average) ``array`` over all workers; returns a Handle whose ``wait()`` gives
        the result, written into ``out`` (default: ``array`` itself, in place). ``ctx`` is the
        step context every codec and reducer of the round sees (``lr`` sets its learning rate)."""
        tensor, array, out, ctx = self._open_reduce(array, name, ctx, out, lr)
        context = encode_context(ctx)  # a bad entry is the caller's error, raised here
        if tensor.busy:
            raise RuntimeError(f"push_pull({name!r}) while the previous one is still running; wait for it first")
        if self.io is None or array.size == 0:  # single process, or nothing to sum
            if out is not array:
                np.copyto(out, array)
            return Handle(self, tensor, out, out.reshape(-1), 0, average, ctx)
        host_level = self.host is not None and self.host.carries(tensor)
        if phases(tensor) > 1 and not (host_level and host_first(tensor)):
            return self._reduce_in_phases(tensor, array, out, average, ctx, priority)
        flat = np.ascontiguousarray(array).reshape(-1)
        if host_level or tensor.local:  # summed in shared memory (two levels: thc's phases between
            # the host's sum and its copy out too)
            wire = out.reshape(-1)
            tensor.busy = True
            handle = Handle(self, tensor, out, wire, 1, average, ctx)
            if self.elastic is not None:  # two levels: the replies are those of the partitions it owns
                self.elastic.opened(handle, len(self.host.owned(tensor)))
            local, rnd = self.host_memory.prepare(tensor, flat)
            local.priority = priority  # two levels: the owner's push
            self.io.post(StartLocal(local, rnd, handle, wire, average))
            return handle
        if tensor.wire_dtype != array.dtype:  # fp16 on the wire: push and pull a cast copy
            wire = source = flat.astype(tensor.wire_dtype)
        elif out is array:  # in place: the reply lands where the push was sent from
            wire = source = flat
        else:
            wire, source = out.reshape(-1), flat
        if average and servers_average(self, tensor):  # the mean rounded once (wire/half.py)
            context, average = encode_context({**ctx, SERVER_MEAN: True}), False
        tensor.busy = True
        handle = Handle(self, tensor, out, wire, len(tensor.partitions), average, ctx)
        if self.elastic is not None:
            self.elastic.opened(handle, len(tensor.partitions))
        nbytes = flat.size * tensor.wire_dtype.itemsize
        # one update per call (a lock each); compressed partitions add their wire bytes when encoded
        self.counters.add(pushed_raw=0 if tensor.auxiliary else nbytes,
                          pushed_wire=0 if tensor.compressed else nbytes)
        for part in tensor.partitions:
            chunk = source[part.start:part.stop]
            dest = wire[part.start:part.stop]
            if part.codec is None:
                push = Push(handle, part, chunk, False, context, priority, tensor.wire_dtype, dest.view(np.uint8))
                self.io.prefill(push)
                self.io.post(SendPush(push))
            else:
                self.compressed_pushes.submit(handle, part, chunk, ctx, context, priority, tensor.wire_dtype)
        return handle

    def all_reduce(self, array, average=False):
        """A plain sum through the servers, under a name of its own for each shape and dtype,
        declared by the first call (alike on every worker: they call it in the same order)."""
        array = np.asarray(array)
        name = f"all_reduce.{array.dtype}.{'x'.join(map(str, array.shape))}"
        if name not in self.tensors:
            self.declare(name, shape=array.shape, dtype=array.dtype)
        return self.reduce(array, name, average=average).wait()

    def partitions(self, name):
        """None of them where the host level carries ``name``: its owner compresses the host's
        sum, so a rank's own payloads would reach servers that count one push per host. The
        binding then keeps the host path (docs/device_codecs.md)."""
        tensor = self.tensors.get(name)
        if self.host is not None and tensor is not None and self.host.carries(tensor):
            return []
        return super().partitions(name)

    def push_payloads(self, name, payloads, ctx=None, priority=0):
        """Push ``name``'s partitions compressed by the caller (a binding's device chains, one
        uint8 array per partition of ``partitions(name)``); ``wait()`` returns each partition's
        reply undecoded, as [(reply, compressed)] (payloads.py)."""
        return push_payloads(self, name, payloads, ctx, priority)

    def _reduce_in_phases(self, tensor, array, out, average, ctx, priority):
        """A two-phase reduce (comm/phased.py) of every rank's own input (one level; thc's two
        levels run their phases in host.py): each phase a dense reduce of the tensor's phase
        buffer, so workers need not wait for their handles in the same order."""
        source = np.ascontiguousarray(array).reshape(-1)
        if tensor.wire_dtype != array.dtype:  # fp16 on the wire: compress and finish a cast copy
            source = source.astype(tensor.wire_dtype)
        # the Handle copies (and casts) the result into ``out`` unless it is written there
        target = out.reshape(-1) if out.dtype == tensor.wire_dtype else np.empty_like(source)
        workers = self.averaged_over(tensor)  # the pushes each phase sums
        reduction = PhasedReduction(tensor, source, target, ctx, workers, carrier=self.phase_words)
        tensor.busy = True
        handle = Handle(self, tensor, out, target, 1, average, ctx)
        raw = source.size * tensor.wire_dtype.itemsize
        self.counters.add(pushed_raw=raw, pulled_raw=raw)

        def done():
            if average:
                target[:] /= target.dtype.type(workers)
            handle.partition_done()
        self.run_phases(reduction, phase_names(tensor), priority, ctx, handle, done)
        return handle

    def run_phases(self, reduction, names, priority, ctx, handle, done):
        """``reduction``'s phases (comm/phased.py), phase i a dense reduce of tensor ``names[i]``;
        when one phase's sum arrives, its completion queues the next on the codec pool, so no
        thread waits. ``done()`` after the finish; any failure fails ``handle``."""
        def phase(index, summed):
            try:
                if index == len(names):
                    reduction.finish(summed)
                    return done()
                buffer = reduction.first() if index == 0 else reduction.second(summed)
                sent = self.reduce(buffer, names[index], average=False, priority=priority, ctx=ctx)
                sent.then(lambda result: handle.fail(result.error) if result.error is not None
                          else self._submit(handle, phase, index + 1, buffer))
            except Exception as e:
                handle.fail(e)
        self._submit(handle, phase, 0, None)

    def _submit(self, handle, fn, *args):
        try:
            self.pool.submit(fn, *args)
        except RuntimeError as e:  # the interpreter is exiting and has shut the pool down
            handle.fail(e)

    def elastic_start(self, params):
        """BPS_GC_ELASTIC: ``params`` (name -> array, updated in place by the script) are what a
        joining host copies from a member. On a joiner, wait to be admitted, fill them, and
        return the first step it takes part in; elsewhere 0 (ps/worker/joining.py). ``params``
        may instead be a function: ``params()`` gives them as they are now (on the donor, at the
        join), ``params(wanted)`` on the joiner those named by the donor's [(name, dtype, shape)],
        made where missing (state a framework creates lazily, e.g. torch's momentum buffers)."""
        if self.elastic is None:
            return 0
        self.elastic.gate.params = params if callable(params) else dict(params)
        start = self.elastic.gate.join() if self.joining else 0
        self.joining = False  # admitted: a member from here; a later call (another model's state) only names it
        return start

    def state_dict(self):
        """This rank's codec state and the servers' it restores (ps/worker/codec_state.py)."""
        return codec_state.state_dict(self)

    def load_state_dict(self, sd):
        """Restore ``state_dict()``'s result, after declaring, before the first push_pull."""
        codec_state.load_state_dict(self, sd)

    def server_values(self, name, attr):
        """The flat array ``attr`` of the servers' reducer state of ``name`` (DiLoCo's global
        copy: ``outer_sgd``'s ``global_copy``), fetched from its servers (codec_state.py)."""
        return np.concatenate(codec_state.server_values(self, name, attr))

    @property
    def runs_server_reducers(self):
        return self.alone is None  # a lone worker never reaches the servers

    def set_server_values(self, name, attr, flat):
        """Seed ``attr`` of the servers' reducer state of ``name``, before its first push_pull
        (the partitions this rank restores: codec_state.py)."""
        codec_state.set_server_values(self, name, attr, np.asarray(flat).reshape(-1))

    # ------------------------------------------------------------------ collectives

    def barrier(self):
        self.check_alive()
        if self.io is None:
            return
        self.io.wait_declared(self.check_alive)  # after it, any worker may ask for a key's state
        done = threading.Event()
        self.io.post(Barrier(done))
        while not done.wait(0.2):
            if self.io.failure is not None:  # failed after the post, before taking it
                break
        self.check_alive()

    def broadcast(self, array, root_rank, name):
        """Every worker ends with root_rank's ``array`` (in place); the others' values are
        replaced. A sum where only the root contributes."""
        if not 0 <= root_rank < self.size:
            raise ValueError(f"broadcast: root_rank {root_rank} outside [0, {self.size})")
        key = f"broadcast.{name}"
        if key not in self.tensors:
            self.declare(key, shape=np.shape(array), dtype=np.asarray(array).dtype)
        if self.rank != root_rank:
            array[...] = 0
        return self.push_pull(array, key, average=False).wait()

    # ------------------------------------------------------------------ worker to worker

    def send(self, rank, name, payload):
        return self._peers().send(rank, name, payload)

    def recv(self, rank, name, timeout=None):
        return self._peers().recv(rank, name, timeout)

    def _peers(self):
        self.check_alive()
        if self.peers is None:
            raise RuntimeError("bps_gc: worker-to-worker send/recv needs the peer links "
                               "(ps.worker.peers), which this worker does not have")
        return self.peers

    def metrics(self):
        """The metrics since the last call (a comm/metrics.Metrics), and reset them."""
        current = self.counters.take()
        log.info("worker %d: pushed %d B (%d on the wire), pulled %d B (%d), ratio %.1f, "
                 "compress %.3f s, communicate %.3f s, wait %.3f s", self.rank, current.pushed_raw,
                 current.pushed_wire, current.pulled_raw, current.pulled_wire, current.ratio,
                 current.compress_seconds, current.communicate_seconds, current.wait_seconds)
        return current
