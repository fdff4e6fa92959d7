"""The worker core: numpy in, numpy out, no framework.

Each worker process (one per local rank) joins the cluster and pushes its own tensors; the
servers sum DMLC_NUM_WORKER * BYTEPS_LOCAL_SIZE pushes (local ranks are not pre-reduced). With
one worker process and BYTEPS_FORCE_DISTRIBUTED unset, nothing leaves the process.
"""
import concurrent.futures
import dataclasses
import logging
import threading
import time

import numpy as np
import zmq

from ..transport.sockets import Auth
from .membership import Membership
from .peers import Peers
from .worker_io import Push, WorkerIO
from .worker_tensors import Placement, TensorPlan

log = logging.getLogger("bps_gc.worker")


@dataclasses.dataclass
class Metrics:
    """Counters since the last ``Worker.step_metrics()`` (bytes and seconds)."""
    pushed_raw: int = 0
    pushed_wire: int = 0
    pulled_raw: int = 0
    pulled_wire: int = 0
    compress_seconds: float = 0.0
    communicate_seconds: float = 0.0
    wait_seconds: float = 0.0

    @property
    def ratio(self):
        wire = self.pushed_wire + self.pulled_wire
        return (self.pushed_raw + self.pulled_raw) / wire if wire else 1.0


class Handle:
    """The result of a push_pull: ``wait()`` returns the output array, ``poll()`` says if done."""

    def __init__(self, worker, tensor, out, wire, count, average):
        self.worker, self.tensor, self.out, self.wire = worker, tensor, out, wire
        # the result is pulled into ``wire``; it is copied to ``out`` unless they are one buffer
        self.copy_back = wire.dtype != out.dtype or \
            wire.__array_interface__["data"][0] != out.__array_interface__["data"][0]
        self.remaining, self.average = count, average
        self.error = None
        self.event = threading.Event()
        self.lock = threading.Lock()
        if count == 0:
            self.finish()

    def poll(self):
        return self.event.is_set()

    def wait(self, timeout=None):
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        while not self.event.wait(0.2):
            failure = self.worker.io.failure if self.worker.io else None
            if failure is not None and not self.event.is_set():
                self.fail(failure)
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError(f"push_pull of {self.tensor.name!r} not done after {timeout} s")
        self.worker.metrics.wait_seconds += time.perf_counter() - start
        if self.error is not None:
            raise self.error
        return self.out

    def fail(self, error):
        with self.lock:
            if self.event.is_set():
                return
            self.error = error
            self.tensor.busy = False
            self.event.set()

    def partition_replied(self, push, payload, compressed, seconds):
        """Called on the I/O thread when a partition's reply arrived."""
        m = self.worker.metrics
        m.communicate_seconds += seconds
        m.pulled_raw += push.part.n * push.dtype.itemsize
        m.pulled_wire += len(payload) if payload is not None and compressed else push.part.n * push.dtype.itemsize
        if compressed or self.average or payload is not push.dest:
            try:
                self.worker.pool.submit(self.decode, push, payload, compressed)
            except RuntimeError as e:  # the interpreter is exiting and has shut the pool down;
                self.fail(e)           # the I/O thread must live on to say goodbye
        else:
            self.partition_done()

    def decode(self, push, payload, compressed):
        try:
            dest = self.wire[push.part.start:push.part.stop]
            if compressed:
                push.part.codec.decompress(payload, dest)
            elif payload is not push.dest:  # an async snapshot of a compressed key
                dest[:] = np.frombuffer(payload, push.dtype)
            if self.average:
                dest /= dest.dtype.type(self.worker.size)
            self.partition_done()
        except Exception as e:
            self.fail(e)

    def partition_done(self):
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.finish()

    def finish(self):
        try:
            if self.copy_back:
                np.copyto(self.out.reshape(-1), self.wire, casting="unsafe")
        except Exception as e:
            return self.fail(e)
        self.tensor.busy = False
        self.event.set()


class Worker:
    def __init__(self, cfg, codecs):
        self.cfg, self.codecs = cfg, codecs
        self.rank, self.size = cfg.rank, cfg.size
        self.local_rank, self.local_size = cfg.local_rank, cfg.local_size
        self.tensors = {}
        self.metrics = Metrics()
        self.io = None
        self.pool = None
        self.placement = None
        self.peers = None
        self.closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(self.cfg.threadpool_size, "bps_gc-codec")
        if not self.cfg.distributed and self.size == 1:
            self.peers = Peers(None, self.cfg, None, self.rank, self.size, None, log)
            return self
        self.ctx = zmq.Context()
        self.auth = Auth(self.ctx, self.cfg.auth_token, self.cfg.encrypt)
        self.membership = Membership(self.ctx, self.cfg, self.auth, "worker", rank=self.rank)
        # bound before the join: its address travels in REGISTER into the address book
        self.peers = Peers(self.ctx, self.cfg, self.auth, self.rank, self.size, self.membership.host, log)
        self.membership.port = self.peers.port
        book = self.membership.join(self.cfg.join_timeout)
        servers = book["servers"]
        self.peers.connect(book["workers"], lambda: self.io.failure if self.io else None, self.membership.left)
        self.io = WorkerIO(self.ctx, self.cfg, self.auth, self.membership, servers, self.rank,
                           self.cfg.inflight_bytes)
        self.placement = Placement(len(servers), self.cfg.partition_bytes, self.cfg.min_compress_bytes)
        self.io.thread.start()
        self.barrier()
        log.info("worker %d/%d joined (%d servers)", self.rank, self.size, len(servers))
        return self

    def shutdown(self, timeout=10.0):
        if self.closed:
            return
        self.closed = True
        if self.io is not None:
            if self.io.failure is None and not self.io.done.is_set():
                self.io.post("goodbye", timeout)
                self.io.done.wait(timeout + 1)
            self.io.close()
            self.peers.close()
            self.membership.close()
            self.auth.stop()
            self.ctx.term()
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def check_alive(self):
        if self.closed:
            raise RuntimeError("bps_gc: the worker was shut down")
        if self.io is not None and self.io.failure is not None:
            raise self.io.failure

    # ------------------------------------------------------------------ tensors

    def declare(self, name, shape=None, dtype=None, **compression):
        """Register ``name`` with its compression; every worker must declare the same names in
        the same order. With ``shape`` and ``dtype`` its partitions are placed now (balanced by
        bytes), else at its first push_pull."""
        self.check_alive()
        if not isinstance(name, str) or not name:
            raise ValueError(f"declare: name must be a non-empty string, got {name!r}")
        params = self.codecs.CompressionParams.from_dict(compression)
        existing = self.tensors.get(name)
        if existing is not None:
            if existing.params != params:
                raise ValueError(f"declare: {name!r} was declared before with different compression "
                                 f"({existing.params.to_dict()} vs {params.to_dict()})")
            return existing
        tensor = TensorPlan(name, len(self.tensors), params)
        self.tensors[name] = tensor
        if shape is not None:
            self._place(tensor, shape, np.dtype(dtype or np.float32), balanced=True)
        return tensor

    def _place(self, tensor, shape, dtype, balanced):
        if dtype not in (np.float32, np.float64, np.float16):
            raise TypeError(f"{tensor.name!r}: dtype {dtype} is not supported (float16/32/64)")
        if self.placement is None:  # not distributed: nothing to place
            tensor.shape, tensor.dtype = tuple(shape), dtype
            return
        self.placement.plan(tensor, shape, dtype, self._build_codec, balanced)
        for part in tensor.partitions:
            self.io.post("init", part.key, part.server, tensor.wire_dtype, tensor.describe(part))

    def _build_codec(self, params, n, dtype, key):
        return self.codecs.build_chain(params, n, dtype, key=key, role="worker")

    def push_pull(self, array, name, average=True, priority=0, lr=0.0, out=None):
        """Sum (or average) ``array`` over all workers; returns a Handle whose ``wait()`` gives
        the result, written into ``out`` (default: ``array`` itself, in place)."""
        self.check_alive()
        tensor = self.tensors.get(name)
        if tensor is None:
            raise KeyError(f"push_pull: {name!r} was not declared; call declare({name!r}, ...) first")
        array = np.asarray(array)
        out = array if out is None else out
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"push_pull({name!r}): the output must be a writable C-contiguous numpy array")
        if out.shape != array.shape:
            raise ValueError(f"push_pull({name!r}): out has shape {out.shape}, input {array.shape}")
        if tensor.shape is None:
            self._place(tensor, array.shape, array.dtype, balanced=False)
        elif tuple(array.shape) != tensor.shape or array.dtype != tensor.dtype:
            raise ValueError(f"push_pull({name!r}): got {array.shape} {array.dtype}, but it was first "
                             f"used as {tensor.shape} {tensor.dtype}")
        if tensor.busy:
            raise RuntimeError(f"push_pull({name!r}) while the previous one is still running; wait for it first")
        if self.io is None:  # single process: the sum is the input
            if out is not array:
                np.copyto(out, array)
            return Handle(self, tensor, out, out.reshape(-1), 0, average)
        flat = np.ascontiguousarray(array).reshape(-1)
        if tensor.wire_dtype != array.dtype:  # fp16 on the wire: push and pull a cast copy
            wire = source = flat.astype(tensor.wire_dtype)
        elif out is array:  # in place: the reply lands where the push was sent from
            wire = source = flat
        else:
            wire, source = out.reshape(-1), flat
        tensor.busy = True
        handle = Handle(self, tensor, out, wire, len(tensor.partitions), average)
        for part in tensor.partitions:
            chunk = source[part.start:part.stop]
            dest = wire[part.start:part.stop]
            self.metrics.pushed_raw += chunk.nbytes
            if part.codec is None:
                self.metrics.pushed_wire += chunk.nbytes
                self.io.post("push", Push(handle, part, chunk, False, lr, priority, tensor.wire_dtype,
                                          dest.view(np.uint8)))
            else:
                self.pool.submit(self._compress, handle, part, chunk, lr, priority, tensor.wire_dtype)
        return handle

    def _compress(self, handle, part, chunk, lr, priority, dtype):
        try:
            start = time.perf_counter()
            payload = part.codec.compress(chunk, lr)
            self.metrics.compress_seconds += time.perf_counter() - start
            self.metrics.pushed_wire += payload.nbytes
            self.io.post("push", Push(handle, part, payload, True, lr, priority, dtype, None))
        except Exception as e:
            handle.fail(e)

    # ------------------------------------------------------------------ collectives

    def barrier(self):
        self.check_alive()
        if self.io is None:
            return
        self.io.barrier_event.clear()
        self.io.post("barrier")
        while not self.io.barrier_event.wait(0.2):
            pass
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

    def step_metrics(self):
        """The metrics since the last call, and reset them."""
        current, self.metrics = self.metrics, Metrics()
        log.info("worker %d: pushed %d B (%d on the wire), pulled %d B (%d), ratio %.1f, "
                 "compress %.3f s, communicate %.3f s, wait %.3f s", self.rank, current.pushed_raw,
                 current.pushed_wire, current.pulled_raw, current.pulled_wire, current.ratio,
                 current.compress_seconds, current.communicate_seconds, current.wait_seconds)
        return current
