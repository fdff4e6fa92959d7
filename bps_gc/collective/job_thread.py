"""``JobThread``: one thread running jobs in the order they were submitted. The collective
communicator's exchange thread is one (its ``exchanger``: flushed buckets are compressed and
exchanged there, in the order they were flushed, so a gradient hook that fills a bucket returns
at once); so are the three stages of the compressed exchange's pipeline (exchange/pipeline.py:
compress, gather, reduce). A job is a function and its arguments (``submit(stage, job)``), so
what it works on is a named object a reader can follow, not a closure.

Why the order of collectives stays the same on every rank: only the caller's thread flushes
buckets (at the same point on every rank: the interface's contract), and this one thread runs
them first in, first out; a collective the caller issues itself (all_reduce, broadcast,
barrier, majority's vote, send/recv) first waits until this thread is idle (``drain``). So
every rank issues its collectives on the default group in exactly the sequence it would issue
them on one thread, and gloo sees them from one thread at a time.
"""
import queue
import threading

from ..comm.exit_threads import join_at_exit


class JobFailed(RuntimeError):
    """A job's function raised where no job records its errors (calling it failed: a
    programming error, not a peer's or a codec's)."""


class JobThread:
    """One daemon thread running jobs (``fn(*args)``) in submission order; ``idle()`` when all
    have run. A daemon: a job blocked on a dead peer never keeps the process alive (its waits poll the
    heartbeat, so it ends anyway within the heartbeat's bound)."""

    def __init__(self, name):
        self.name, self.jobs, self.thread = name, queue.SimpleQueue(), None
        self.submitted = self.completed = 0
        self.changed = threading.Condition()
        self.failure = None  # the first JobFailed: raised by every later wait_idle

    def submit(self, fn, *args):
        with self.changed:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()
                # joined at exit (comm/exit_threads.py): told to stop after its jobs first
                join_at_exit(self.thread, lambda jobs=self.jobs: jobs.put(None))
            # counted and queued with no call between (a signal handler runs only at one): a
            # Ctrl-C at the lock's release once could leave a job counted and never queued, and
            # the rank's drain at exit waited for it for ever
            self.submitted += 1
            self.jobs.put((fn, args))

    def idle(self):
        return self.completed == self.submitted

    def wait_idle(self, seconds):
        """True once every submitted job ran; False after ``seconds`` otherwise. Raises the
        JobFailed of a job whose function raised (``_escaped``)."""
        with self.changed:
            idle = self.changed.wait_for(self.idle, seconds)
        if self.failure is not None:
            raise self.failure
        return idle

    def stop(self):
        if self.thread is not None:
            self.jobs.put(None)
            self.thread = None

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)  # a job records its own errors (on its bucket or future)
            except BaseException as e:  # noqa: BLE001 -- one no job recorded: see _escaped
                self._escaped(fn, args, e)
            finally:
                job = fn = args = None  # not held while waiting for the next (its payloads, buffers)
                with self.changed:
                    self.completed += 1
                    self.changed.notify_all()

    def _escaped(self, fn, args, error):
        """``fn(*args)`` raised ``error`` past the job's own handling (calling it failed). Printed
        by the thread alone, the job would never end and its caller would wait for ever: each
        argument that can (``abandon(error)``: a bucket, a segment, a pipeline job) ends with it,
        and every later ``wait_idle`` raises it."""
        what = getattr(fn, "__qualname__", None) or repr(fn)
        failure = JobFailed(f"bps_gc: {self.name}: {what} failed: {type(error).__name__}: {error}")
        failure.__cause__ = error
        if self.failure is None:
            self.failure = failure
        for arg in args:
            abandon = getattr(arg, "abandon", None)
            if callable(abandon):
                try:
                    abandon(failure)
                except Exception:  # noqa: BLE001 -- the others still end; the failure stays raised
                    pass
