"""The collective communicator's start, end and waits (a part of ``Collective``).

Every wait polls the heartbeat (liveness.py): a dead rank raises NodeFailure within the
heartbeat bound, and one that shut down (departure.py) as soon as this rank waits on anything it
never issued; so every collective and message is counted (``issue``), per group: the compressed
exchange's pipeline (collective/exchange/driver.py) counts its collectives here too, on the
groups it runs on.
"""
import logging
import threading
import time

import torch.distributed as dist

from ..comm import NodeFailure, exit_threads
from ..comm.communicator import PEER_GONE
from .after_failure import end_after_failure, failure_bound
from .departure import Ending, await_end, departure, described, first_leaver
from .liveness import Heartbeat
from .backend_choice import SHARED
from .rendezvous import adopt, backend_from_env, connect, waiting_at_rendezvous

log = logging.getLogger("bps_gc.collective")
WATCH_SECONDS = 0.02  # how often a wait sleeping on its work checks the heartbeat and departures


class Lifecycle:
    """The rank's life in the job: ``start`` (rendezvous, heartbeat), ``shutdown`` (publish what
    this rank did, wait for the others: departure.py), ``check_alive``, and the waits every
    other part calls: ``wait`` (a torch.distributed work, watching the heartbeat and departures),
    ``drain`` (the exchange thread idle) and ``issue`` (count a collective as it goes out).
    Writes ``shared.heartbeat``, ``shared.failure`` and ``shared.issued``; keeps ``closed``,
    ``abandoned``, ``awaiting`` and ``hosts_store`` to itself."""

    def __init__(self, cfg, shared, exchanger, local_size):
        """``shared``: shared.Shared; ``exchanger``: the exchange thread (job_thread.JobThread);
        ``local_size``: the ranks on this host (they may share a GPU: backend_choice.py)."""
        self.cfg, self.shared, self.exchanger, self.local_size = cfg, shared, exchanger, local_size
        self.rank, self.size = shared.rank, shared.size
        self.closed = False
        self.hosts_store = False
        self.adopted = False  # the default process group was the script's (made before start)
        self.awaiting = None  # the message this rank last told the store it waits for
        self.abandoned = None  # the uncaught exception the script ends on, if any
        self.counting = threading.Lock()  # the exchange thread and the pipeline's count at once
        self.members = {}  # process group -> its sorted global ranks (None: every rank)

    def start(self, join_levels, barrier):
        """Rendezvous and heartbeat, then ``join_levels`` (TwoLevelReductions') and a first ``barrier``."""
        self.adopted = dist.is_initialized()
        if self.adopted:  # the script's own default group: it keeps it (and tears it down)
            backend, why = dist.get_backend(), "the script's process group"
            store, self.hosts_store = adopt(self.cfg)
        else:
            backend, why = backend_from_env(local_size=self.local_size)
            if self.rank == 0 and SHARED in why:  # ranks share a GPU: gloo where NCCL was expected
                log.warning("bps_gc: %s", why)
            with waiting_at_rendezvous(self.cfg):
                store, self.hosts_store = connect(self.cfg, backend)
        where = f"{self.cfg.root_uri}:{self.cfg.root_port}"
        self.shared.heartbeat = Heartbeat(store, self.rank, self.size, self.cfg.heartbeat_interval,
                                          self.cfg.heartbeat_timeout, where).start()
        join_levels()
        barrier()
        log.info("rank %d/%d joined over torch.distributed (%s: %s; %s)", self.rank, self.size, backend,
                 why, "two levels" if self.shared.levels else "one level")

    def shutdown(self, timeout, flush):
        """Publish what this rank did, wait for the others to end (departure.py); a last
        barrier and the group's teardown only when all ended at the same point. ``flush``:
        the buckets' (the last one goes out first)."""
        if self.closed:
            return
        shared = self.shared
        failed = shared.failure is not None or (shared.heartbeat is not None and shared.heartbeat.failure is not None)
        if not failed:
            try:
                flush()
                self.drain()  # every collective issued before the count is published
            except (NodeFailure, RuntimeError):  # a peer failed while the last bucket went out
                failed = True
        self.exchanger.stop()  # after a failure it may still wait on the dead peer: a daemon
        self.closed = True
        clean = not failed
        if shared.heartbeat is not None and shared.heartbeat.store is not None and self.size > 1:
            with self.counting:
                mine = Ending(shared.issued, tuple(shared.sent), tuple(shared.received), failed, self.abandoned,
                              tuple(sorted(shared.issued_on.items())))
            shared.heartbeat.announce(mine)
            clean = await_end(shared.heartbeat, mine, self.hosts_store, self.cfg.join_timeout)
            shared.heartbeat.leave()
        if shared.levels is not None:
            shared.levels.close()
        if not clean and dist.is_initialized():
            end_after_failure(self.rank, failure_bound(self.cfg), exit_threads.exiting(), self.abandoned,
                              linger=lambda: self._until_the_others_read(4 * self.cfg.heartbeat_interval))
        if clean and dist.is_initialized():
            try:
                dist.barrier()  # nobody tears down its pairs while a peer still sends
                if not self.adopted:
                    dist.destroy_process_group()
            except RuntimeError as e:
                log.warning("rank %d: the process group's teardown failed: %s", self.rank, e)

    def _until_the_others_read(self, limit):
        """Wait (at most ``limit`` s) until every rank still running has read this rank's
        Ending: the rendezvous store may live in this process or beside it (bpslaunch's rank 0,
        torchrun's agent), and a rank that reads the store no more names its end, not who left."""
        heartbeat = self.shared.heartbeat
        if heartbeat is None or heartbeat.store is None:
            return
        waiting, deadline = [r for r in range(self.size) if r != self.rank and r not in heartbeat.ended], \
            time.monotonic() + limit
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not heartbeat.seen_by(r)]
            time.sleep(heartbeat.interval / 4)

    def abandon(self, reason):
        self.abandoned = reason

    def peer_failure(self, error):
        """A gloo error of a collective bps_gc did not issue (FSDP2's all_gather, a user's
        all_reduce): the rank that died (the heartbeat's bound, twice, to say so) or left (its
        Ending) if there is one; the Ending this rank then publishes says it failed, so the
        others name that rank too."""
        heartbeat = self.shared.heartbeat
        if heartbeat is None or not (isinstance(error, RuntimeError) and PEER_GONE.search(str(error))):
            return None  # a script's own error: its traceback as it is

        def named():
            if self.shared.failure is not None:
                return self.shared.failure
            # a rank that left before the store's host went is the cause to name, not the store
            if heartbeat.failure is not None and not (heartbeat.store_gone and heartbeat.ended):
                self.shared.failure = heartbeat.failure
            elif heartbeat.ended:
                rank, end = first_leaver(list(heartbeat.ended.items()))
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                self.shared.failure = NodeFailure(f"bps_gc: rank {rank} left the job ({end.how()}) while rank "
                                                  f"{self.rank} was in a collective bps_gc does not count: {first}")
            return self.shared.failure
        return self._within_heartbeat_bound(named)

    def _within_heartbeat_bound(self, named):
        """``named()`` polled until it gives a failure (returned; or raises it) or the heartbeat
        had twice its bound to name a dead or departed peer (None): its thread may run late on a
        busy host."""
        deadline = time.monotonic() + failure_bound(self.cfg)
        while time.monotonic() < deadline:
            failure = named()
            if failure is not None:
                return failure
            time.sleep(self.cfg.heartbeat_interval / 4)
        return None

    def check_alive(self):
        if self.closed:
            raise RuntimeError("bps_gc: the collective communicator was shut down")
        heartbeat = self.shared.heartbeat
        if heartbeat is not None and heartbeat.failure is not None:
            self.shared.failure = heartbeat.failure
            raise heartbeat.failure

    def drain(self):
        """Wait until the exchange thread issued every flushed bucket (before this thread issues
        a collective itself: the order every rank issues them in), watching the heartbeat; a
        failure the thread met is raised here too."""
        while not self.exchanger.wait_idle(0.05):
            self.check_alive()
        if self.shared.failure is not None:
            raise self.shared.failure

    def wait(self, work, what, message=None, *, group=None):
        """Wait for a torch.distributed work item, watching the heartbeat and the ranks that
        shut down meanwhile. ``what`` names it in an error: a string, or a function making one
        (only called then). ``group``: the process group of a collective ``issue`` counted on
        it (None: every rank's): only its members' departures fail it. Gloo's send/recv works
        (``message``: ("recv" | "send", peer, n)) only complete inside a blocking wait(): a dead
        or departed peer then shows as gloo's socket error, which the heartbeat names."""
        if message is not None and self.shared.heartbeat is not None:
            self._check_departures(what, message)
            if message != self.awaiting:  # a message's two works: one note in the store
                self.shared.heartbeat.waiting_for(*message)
                self.awaiting = message
        if message is None and not work.is_completed():
            # sleep until the work's future wakes this thread, checking the heartbeat and the
            # departed ranks each WATCH_SECONDS (polling would take the cores that several ranks
            # of a host, or the hook's threads beside backward, need); on a lock held here that
            # the future releases once: less CPU a wait than an Event (whose Condition makes a
            # lock of its own each wait)
            done = threading.Lock()
            done.acquire()
            work.get_future().add_done_callback(lambda _: done.release())
            while True:
                self._check_departures(what, group=group)
                self.check_alive()
                if done.acquire(timeout=WATCH_SECONDS):
                    break
        try:
            work.wait()
        except RuntimeError as e:  # a peer's socket closed: let the heartbeat name who (both raise)
            self._within_heartbeat_bound(lambda: self._check_departures(what, message, group) or self.check_alive())
            self.shared.failure = NodeFailure(f"bps_gc: {described(what)} failed on rank {self.rank}: {e}")
            raise self.shared.failure from None

    def _check_departures(self, what, message=None, group=None):
        heartbeat = self.shared.heartbeat
        if heartbeat is None or not heartbeat.ended:  # the usual case, on every spin
            return
        members, ended = self._members(group), heartbeat.ended
        if members is not None:
            # a sub-group's leaver whose script raised may have raised on a peer that died in a
            # collective bps_gc does not watch (FSDP2's own, on another group): it is named once
            # the heartbeat had its bound to name that peer first
            settled = time.monotonic() - self.cfg.heartbeat_timeout - 2 * self.cfg.heartbeat_interval
            ended = {r: e for r, e in list(ended.items()) if not e.raised or heartbeat.ended_at.get(r, 0) < settled}
        issued = self.shared.issued if members is None else self.shared.issued_on.get(members, 0)
        failure = departure(ended, self.rank, issued, what, message, members)
        if failure:
            self.shared.failure = failure
            raise failure

    def issue(self, work, group=None):
        """Count a collective as it is issued on ``group`` (None: every rank's; the members of a
        group issue its collectives in the same order). ``work`` None: one this rank skips
        that the others count (the levels'). Returns ``work``."""
        members = self._members(group)
        with self.counting:
            if members is None:
                self.shared.issued += 1
            else:
                self.shared.issued_on[members] = self.shared.issued_on.get(members, 0) + 1
        return work

    def _members(self, group):
        """``group``'s sorted global ranks, None when it is every rank (the world's count)."""
        if group is None:
            return None
        members = self.members.get(group, False)
        if members is False:
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
            members = self.members[group] = None if len(ranks) == self.size else ranks
        return members
