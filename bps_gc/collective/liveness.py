"""Finding a dead rank in seconds, not at gloo's timeout.

Every rank bumps its counter in the shared store each heartbeat interval and reads everyone
else's; a counter that stops moving for the heartbeat timeout names a dead (or hung) rank, the
same bound (BPS_GC_HEARTBEAT_TIMEOUT + interval) as the parameter server's scheduler. A rank that
shuts down publishes its Ending first (departure.py); the heartbeat collects the others', so
their silence is no failure and what they left undone fails at once. A store that stops
answering means its host (rank 0, or torchrun's agent) is gone.
"""
import logging
import threading
import time

from ..roles import NodeFailure
from .departure import Ending

log = logging.getLogger("bps_gc.collective")


class Heartbeat:
    def __init__(self, store, rank, size, interval, timeout, where):
        self.store, self.rank, self.size = store, rank, size
        self.interval, self.timeout, self.where = interval, timeout, where
        self.failure = None
        self.ended = {}  # rank -> Ending, of the other ranks that shut down
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bps_gc-heartbeat", daemon=True)

    def start(self):
        if self.store is not None and self.size > 1:
            self.thread.start()
        return self

    def announce(self, ending):
        """Tell the others this rank shuts down, and what it did (departure.Ending)."""
        self._quietly(self.store.set, f"ending/{self.rank}", ending.encode())
        self._quietly(self.store.add, "endings", 1)  # one counter to poll, not a key per rank

    def waiting_for(self, kind, peer, n):
        """About to block on the n-th message with ``peer`` ("recv" | "send")."""
        self._quietly(self.store.set, f"awaiting/{self.rank}", f"{kind} {peer} {n}")

    def seen_by(self, rank):
        """Whether ``rank`` has read this rank's Ending."""
        try:
            return self.store.check([f"seen/{self.rank}/{rank}"])
        except Exception:  # the store's host is gone: nobody can read it any more
            return True

    def awaiting(self, rank):
        key = f"awaiting/{rank}"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else ""
        except Exception:  # the store's host is gone (the heartbeat reports it)
            return ""

    def leave(self):
        """Stop beating (after announce: the others take the silence for the end)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()

    def _quietly(self, call, *args):
        try:
            call(*args)
        except Exception:  # the store's host may already be gone at the end of a job
            pass

    def _run(self):
        others = [r for r in range(self.size) if r != self.rank]
        seen = {r: (None, time.monotonic()) for r in others}
        endings = 0
        while not self.stopping.wait(self.interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                endings, before = self.store.add("endings", 0), endings
                for r in others:
                    if endings != before and r not in self.ended and self.store.check([f"ending/{r}"]):
                        self.ended[r] = Ending.decode(self.store.get(f"ending/{r}"))
                        self.store.set(f"seen/{r}/{self.rank}", "1")
                    count = self.store.add(f"beat/{r}", 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.timeout and r not in self.ended:
                        self._fail(f"rank {r} sent no heartbeat for {self.timeout:g} s: it died or hangs")
                        return
            except Exception as e:
                host = self.ended.get(0)
                if self.stopping.is_set():
                    return
                self._fail(f"rank 0 left the job ({host.how()}) and took the rendezvous store with it"
                           if host is not None else f"the rendezvous store at {self.where} stopped "
                           f"answering (its host, rank 0 or torchrun's agent, died?): {e}")
                return

    def _fail(self, message):
        self.failure = NodeFailure(f"bps_gc: {message}")
        log.error("rank %d: %s", self.rank, message)
