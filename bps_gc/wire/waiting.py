"""Lines that say what a blocked start-up wait is waiting for (a node joining the scheduler,
the scheduler for its nodes, a rank for the torch.distributed rendezvous), so that a wrong
address is not minutes of silence.

The first line comes FIRST_LINE seconds into the wait (a wait that ends sooner says nothing),
then one every EVERY seconds, each with the time waited, the limit and the variable that sets it:

    bps_gc: waiting for the scheduler at 10.0.0.1:1234 (5 s of 300; BPS_GC_JOIN_TIMEOUT)
"""
import sys
import threading
import time

FIRST_LINE = 5.0  # seconds
EVERY = 30.0  # seconds


class WaitLines:
    """``what()`` names what is awaited ("waiting for the scheduler at HOST:PORT"); call
    ``tick()`` from the waiting loop (at least every second), or use the object as a context
    manager around a call that blocks (a thread then ticks)."""

    def __init__(self, what, limit, variable="BPS_GC_JOIN_TIMEOUT", out=None):
        self.what, self.limit, self.variable = what, limit, variable
        self.out = out if out is not None else sys.stderr
        self.started = time.monotonic()
        self.due = FIRST_LINE
        self.stop = threading.Event()
        self.thread = None

    def tick(self):
        waited = time.monotonic() - self.started
        if waited < self.due:
            return
        self.due = waited + EVERY
        print(f"bps_gc: {self.what()} ({waited:.0f} s of {self.limit:.0f}; {self.variable})",
              file=self.out, flush=True)

    def __enter__(self):
        def ticking():
            while not self.stop.wait(0.5):
                self.tick()
        self.thread = threading.Thread(target=ticking, name="bps_gc-wait-lines", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
