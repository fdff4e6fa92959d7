"""A push_pull in flight (Handle); it adds what it moved to the worker's Counters (comm/metrics.py)."""
import threading
import time

import numpy as np

from ...comm.communicator import Handle as HandleABC
from ...wire.bfloat16 import BFLOAT16, narrow, widen
from ...wire.half import HALF

# a small dense reply is copied out on the I/O thread: handing it to the codec pool costs more
# than the copy (the fused replies of a ResNet-50 round hold about a hundred such entries)
INLINE_DECODE_BYTES = 64 * 1024


def servers_average(worker, tensor):
    """Whether the servers divide ``tensor``'s sum when it is averaged (wire/half.py): a dense
    float16 or bfloat16 tensor on ``reduce``'s direct path (every worker pushes it, or, declared
    ``one_per_host``, one local rank of each host), whose divisor is then the round's pushers on
    every server alike. Not where a host sums first (its average is over the workers, the
    servers count hosts), nor on async servers (a running sum has no round)."""
    return not tensor.compressed and tensor.wire_dtype in HALF and worker.sums_half \
        and not worker.cfg.enable_async


class Handle(HandleABC):
    """The result of a push_pull: ``wait()`` returns the output array, ``poll()`` says if done.

    ``ctx`` is the step context the partitions were pushed with; reducers decode with it."""

    def __init__(self, worker, tensor, out, wire, count, average, ctx=None):
        self.worker, self.tensor, self.out, self.wire = worker, tensor, out, wire
        self.ctx = ctx
        # the result is pulled into ``wire``; it is copied to ``out`` unless they are one buffer
        self.copy_back = wire.dtype != out.dtype or \
            wire.__array_interface__["data"][0] != out.__array_interface__["data"][0]
        self.remaining, self.average = count, average
        self.error = None
        self.event = threading.Event()
        self.lock = threading.Lock()
        self.callbacks = []  # None once done
        self.group = None  # BPS_GC_ELASTIC: its round group, and the members it is averaged
        self.members = None  # over (elastic.py); None: the worker's size
        if count == 0:
            self.finish()

    def poll(self):
        return self.event.is_set()

    def end_group(self):
        """BPS_GC_ELASTIC: the round group this belongs to, if still open, ends here (as a wait
        ends it), so the next push_pull opens the next group whenever this is waited for."""
        if self.group is not None:
            self.worker.elastic.close(self, self.worker.io)

    def wait(self, timeout=None):
        start = time.perf_counter()
        if self.group is not None:  # waiting closes the round group it belongs to (no call without one)
            self.end_group()
        deadline = None if timeout is None else start + timeout
        while not self.event.wait(0.2):
            io = self.worker.io
            failure = io.failure if io else None
            if failure is None and io is not None and io.done.is_set():
                # the I/O thread ended (shutdown()): no reply can come any more, so a script that
                # exits with an exchange in flight has its waiter thread end now rather than hold
                # the exit for exit_threads' whole bound
                failure = RuntimeError(f"bps_gc: the worker was shut down with the push_pull of "
                                       f"{self.tensor.name!r} in flight")
            if failure is not None and not self.event.is_set():
                self.fail(failure)
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError(f"push_pull of {self.tensor.name!r} not done after {timeout} s")
        self.worker.counters.add(wait_seconds=time.perf_counter() - start)
        if self.error is not None:
            raise self.error
        return self.out

    def then(self, callback):
        """Call ``callback(self)`` once this is done or failed: now if it is, else on the thread
        that completes it (the I/O thread or the codec pool: the callback must not block)."""
        with self.lock:
            if self.callbacks is not None:
                self.callbacks.append(callback)
                return
        callback(self)

    def _done(self, error=None):
        """Set the result (or ``error``) once; True if this call did."""
        with self.lock:
            if self.event.is_set():
                return False
            self.error = error
            self.tensor.busy = False
            self.event.set()
            callbacks, self.callbacks = self.callbacks, None
        for callback in callbacks:
            callback(self)
        return True

    def fail(self, error):
        self._done(error)

    def partition_replied(self, push, payload, compressed, seconds):
        """Called on the I/O thread when a partition's reply arrived."""
        dense = push.part.n * push.dtype.itemsize
        wire = len(payload) if payload is not None and compressed else dense
        raw = 0 if self.tensor.auxiliary else dense  # a phase buffer counts on the wire only
        self.worker.counters.add(communicate_seconds=seconds, pulled_raw=raw, pulled_wire=wire)
        if compressed or self.average or payload is not push.dest:
            if not compressed and push.nbytes <= INLINE_DECODE_BYTES:
                return self.decode(push, payload, compressed)
            try:
                self.worker.pool.submit(self.decode, push, payload, compressed)
            except RuntimeError as e:  # the interpreter is exiting and has shut the pool down;
                self.fail(e)           # the I/O thread must live on to say goodbye
        else:
            self.partition_done()

    def decode(self, push, payload, compressed):
        try:
            dest = self.wire[push.part.start:push.part.stop]
            reducer = push.part.reducer
            count = self.worker.averaged_over(self.tensor, self.members)  # a one_per_host tensor's: the hosts
            if dest.dtype == BFLOAT16:  # dense (placement.check_dtype); averaged here only where the
                # servers do not divide (servers_average): divided in float32, rounded back
                if payload is not push.dest:
                    dest.view(np.uint16)[:] = np.frombuffer(payload, np.uint16)
                if self.average:
                    narrow(widen(dest) / np.float32(count), dest)
                return self.partition_done()
            size = dest.dtype.type(count)
            if compressed:
                reducer.decode(payload, dest, self.ctx)
                if self.average and (reducer is None or reducer.summed):
                    dest /= size
            elif payload is not push.dest:  # a result in shared memory, or an async snapshot
                source = np.frombuffer(payload, push.dtype)
                if self.average:  # one pass; the same values as copying, then dividing
                    np.divide(source, size, out=dest)
                else:
                    dest[:] = source
            elif self.average:
                dest /= size
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
        self._done()
