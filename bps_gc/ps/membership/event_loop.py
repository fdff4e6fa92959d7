"""The one I/O loop every role runs: polling, a wake-up pipe, the heartbeat tick, failures.

A role registers a handler per socket (called when it is readable) and tick functions (called
after every poll, at least every heartbeat interval: heartbeats, the scheduler's dead-node scan,
the server's stall check). Other threads call ``wake()`` after queueing work for the loop.
A handler or tick ends the loop by returning a value other than None (the role's exit status);
a NodeFailure raised anywhere in the loop goes to ``on_failure``, which every role uses to fan
the failure out (fail waiting calls, tell the scheduler) before the loop ends.
"""
import os
import queue

import zmq

from ...comm import NodeFailure


def queued(work):
    """What other threads put on the queue ``work`` so far, taken off it in order (never waits)."""
    while True:
        try:
            yield work.get_nowait()
        except queue.Empty:
            return


class EventLoop:
    def __init__(self, interval):
        self.timeout_ms = max(1, int(interval * 1000))
        self.poller = zmq.Poller()
        self.handlers = {}  # socket or fd -> handler()
        self.ticks = []
        self.wake_r = self.wake_w = None
        self.wake_pending = False  # a wake-up is written and not yet drained: others need not write
        # how long the next poll may wait, given the idle timeout (a role with deadlines of its
        # own, e.g. a fusion cycle, replaces it); always at most the heartbeat interval
        self.poll_timeout = lambda idle_ms: idle_ms

    def on_readable(self, sock, handler):
        self.poller.register(sock, zmq.POLLIN)
        self.handlers[sock] = handler

    def on_tick(self, tick):
        self.ticks.append(tick)

    def wakeable(self, handler):
        """A pipe other threads write to (``wake()``) so that ``handler`` runs on this loop."""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

        def drain_then_handle():
            try:
                os.read(self.wake_r, 65536)
            except BlockingIOError:
                pass
            # after the read (a flag cleared first could be set again by a post whose byte
            # this read then takes, leaving it set with no byte: every later post would skip
            # its write) and before the handler looks for work, so later posts wake again
            self.wake_pending = False
            return handler()

        self.on_readable(self.wake_r, drain_then_handle)

    def wake(self):
        """Make the loop run the wake handler soon. One write per drain: a post that finds a
        wake-up pending skips the syscall (and the thread switch it may cost)."""
        if self.wake_w is None or self.wake_pending:  # closed, or the loop will look anyway
            return
        try:
            self.wake_pending = True
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass  # a wake-up is already pending
        except BaseException:  # Ctrl-C on the posting thread before the byte went out: a flag
            self.wake_pending = False  # left set with no byte would silence every later post
            raise                       # (a worker's goodbye among them: it never left)

    def run(self, on_failure=None):
        """Poll until a handler or tick returns a status; returns it. A NodeFailure is passed to
        ``on_failure`` (whose return value is the status), or raised without one."""
        try:
            while True:
                ready = dict(self.poller.poll(min(self.timeout_ms, self.poll_timeout(self.timeout_ms))))
                for sock, handler in self.handlers.items():  # registration order: wake pipe first
                    if sock in ready:
                        status = handler()
                        if status is not None:
                            return status
                for tick in self.ticks:
                    status = tick()
                    if status is not None:
                        return status
        except NodeFailure as e:
            if on_failure is None:
                raise
            return on_failure(e)

    def close(self):
        for fd in (self.wake_r, self.wake_w):
            if fd is not None:
                os.close(fd)
        self.wake_r = self.wake_w = None
