"""Finding a dead rank in seconds, not at gloo's timeout.

Every rank bumps its counter in the shared store each heartbeat interval and reads everyone
else's; a counter that stops moving for the heartbeat timeout names a dead (or hung) rank, the
same bound (BPS_GC_HEARTBEAT_TIMEOUT + interval) as the parameter server's scheduler. A rank that
leaves cleanly marks itself first. A store that stops answering means its host (rank 0, or
torchrun's agent) is gone.
"""
import logging
import threading
import time

from ..roles import NodeFailure

log = logging.getLogger("bps_gc.collective")


class Heartbeat:
    def __init__(self, store, rank, size, interval, timeout, where):
        self.store, self.rank, self.size = store, rank, size
        self.interval, self.timeout, self.where = interval, timeout, where
        self.failure = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bps_gc-heartbeat", daemon=True)

    def start(self):
        if self.store is not None and self.size > 1:
            self.thread.start()
        return self

    def leave(self):
        """Stop beating, telling the others this rank left on purpose."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()
            try:
                self.store.set(f"left/{self.rank}", "1")
            except Exception:  # the store's host may already be gone at the end of a job
                pass

    def _run(self):
        others = [r for r in range(self.size) if r != self.rank]
        seen = {r: (None, time.monotonic()) for r in others}
        while not self.stopping.wait(self.interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                for r in others:
                    count = self.store.add(f"beat/{r}", 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.timeout and not self._left(r):
                        self._fail(f"rank {r} sent no heartbeat for {self.timeout:g} s: it died or hangs")
                        return
            except Exception as e:
                if not self.stopping.is_set():
                    self._fail(f"the rendezvous store at {self.where} stopped answering (its host, "
                               f"rank 0 or torchrun's agent, died?): {e}")
                return

    def _left(self, rank):
        return self.store.check([f"left/{rank}"])

    def _fail(self, message):
        self.failure = NodeFailure(f"bps_gc: {message}")
        log.error("rank %d: %s", self.rank, message)
