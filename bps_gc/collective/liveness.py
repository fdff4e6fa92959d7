"""Finding a dead rank in seconds, not at gloo's timeout.

Every rank bumps its counter in the shared store each heartbeat interval and reads everyone
else's; a counter that stops moving for the heartbeat timeout names a dead (or hung) rank, the
same bound (BPS_GC_HEARTBEAT_TIMEOUT + interval) as the parameter server's scheduler. A rank that
shuts down publishes its Ending first (departure.py); the heartbeat collects the others', so
their silence is no failure and what they left undone fails at once. A store that stops
answering means its host (rank 0, or torchrun's agent) is gone.
"""
import logging
import os
import signal
import threading
import time

from ..comm import NodeFailure
from .departure import Ending

log = logging.getLogger("bps_gc.collective")


class Heartbeat:
    def __init__(self, store, rank, size, interval, timeout, where):
        self.store, self.rank, self.size = store, rank, size
        self.interval, self.timeout, self.where = interval, timeout, where
        self.failure = None
        self.store_gone = False  # the failure is the store's end: often a consequence, not the cause
        self.ended = {}  # rank -> Ending, of the other ranks that shut down
        self.ended_at = {}  # rank -> time.monotonic() its Ending was read
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
                if endings != before:
                    self._read_endings(others)
                for r in others:
                    count = self.store.add(f"beat/{r}", 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                silent = sorted((seen[r][1], r) for r in others
                                if now - seen[r][1] > self.timeout and r not in self.ended)
                if silent and self._name_silent(silent, now):
                    return
            except Exception as e:
                host = self.ended.get(0)
                if self.stopping.is_set():
                    return
                self._fail(f"rank 0 left the job ({host.how()}) and took the rendezvous store with it"
                           if host is not None else f"the rendezvous store at {self.where} stopped "
                           f"answering (its host, rank 0 or torchrun's agent, died?): {e}")
                self.store_gone = True
                return

    def _read_endings(self, others):
        """Add the Endings published since the last beat to ``ended`` in one update: a waiter
        reading it in between would see a rank that failed because another left, without the
        one that left first (departure.py names the latter)."""
        found = {r: Ending.decode(self.store.get(f"ending/{r}")) for r in others
                 if r not in self.ended and self.store.check([f"ending/{r}"])}
        now = time.monotonic()
        self.ended_at.update((r, now) for r in found)
        self.ended.update(found)
        for r in found:
            self.store.set(f"seen/{r}/{self.rank}", "1")

    def catch_sigterm(self):
        """A launcher stopping this rank (SIGTERM, because a rank beside it failed) is noted in
        the store before the signal takes its course, so the other hosts name the rank that
        failed, not the ones stopped after it. Main thread only (Python's rule for handlers);
        installed with two levels only (a Python handler runs once the main thread is back in
        Python: a rank alone on its host keeps dying at the signal itself)."""
        if self.store is None or self.size == 1 or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            # at most half a second: a store whose host is gone must not hold the signal up
            note = threading.Thread(target=self._quietly, args=(self.store.set, f"signalled/{self.rank}", "SIGTERM"),
                                    daemon=True)
            note.start()
            note.join(0.5)
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            if callable(previous):
                return previous(signum, frame)
            if previous != signal.SIG_IGN:
                os.kill(os.getpid(), signal.SIGTERM)
        signal.signal(signal.SIGTERM, on_sigterm)

    def _name_silent(self, silent, now):
        """Fail naming the rank that fell silent first (``silent``: [(last seen, rank)]), preferring
        one its launcher did not stop; True once failed."""
        stopped = {r for _, r in silent if self.store.check([f"signalled/{r}"])}
        first = next((r for _, r in silent if r not in stopped), None)
        if first is None:  # only ranks stopped by a signal so far: give the cause a while to show
            if now - silent[0][0] <= 2 * self.timeout:
                return False
            first = silent[0][1]
        how = "was stopped (SIGTERM) and sent" if first in stopped else "sent"
        then_stopped = sorted(stopped - {first})
        also_silent = sorted(r for _, r in silent if r != first and r not in stopped)
        notes = ([f"{_ranks(then_stopped)} then stopped by a launcher"] if then_stopped else []) + \
            ([f"{_ranks(also_silent)} silent too"] if also_silent else [])
        self._fail(f"rank {first} {how} no heartbeat for {self.timeout:g} s: it died or hangs"
                   + (f" ({'; '.join(notes)})" if notes else ""))
        return True

    def _fail(self, message):
        self.failure = NodeFailure(f"bps_gc: {message}")
        log.error("rank %d: %s", self.rank, message)


def _ranks(ranks):
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
