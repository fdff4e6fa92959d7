"""Partitions compressed on the codec pool, then handed to the worker's I/O thread as pushes
(``Worker.reduce``'s compressed partitions, and the host level's owners: host.py)."""
import time

from .commands import SendPush
from .push import Push


class CompressedPushes:
    """``submit``: compress one partition with its codec on the codec pool, then post it to the
    I/O thread as a compressed Push; a failure fails the push_pull's handle."""

    def __init__(self, pool, counters, io):
        """``pool``: the codec pool (an Executor); ``counters``: the worker's (comm.metrics.Counters);
        ``io``: the worker's io.WorkerIO."""
        self.pool, self.counters, self.io = pool, counters, io

    def submit(self, handle, part, chunk, ctx, context, priority, dtype):
        """Raises RuntimeError once the pool is shut down (the interpreter is exiting)."""
        self.pool.submit(self.compress, handle, part, chunk, ctx, context, priority, dtype)

    def compress(self, handle, part, chunk, ctx, context, priority, dtype):
        try:
            start = time.perf_counter()
            payload = part.codec.compress(chunk, ctx)
            self.counters.add(compress_seconds=time.perf_counter() - start, pushed_wire=payload.nbytes)
            self.io.post(SendPush(Push(handle, part, payload, True, context, priority, dtype, None)))
        except Exception as e:
            handle.fail(e)
