"""A server's watch over its open rounds: departed workers and stalls.

* A worker that said goodbye while others still run (the scheduler's NODE_LEFT) can never
  push again: every sync round that still needs its push fails at once, with an ERROR to the
  workers that did push and a report to the scheduler, which stops the job naming the worker
  and the tensor (D1). Without this, the others would wait for it forever.
* A round that some ranks pushed and others did not for BPS_GC_STALL_TIMEOUT seconds is
  logged once as a stall, naming the tensor and both sets of ranks (Horovod's stall check:
  ranks that diverge, e.g. skip a tensor or run fewer steps).
"""
import logging
import time

from ...wire.sockets import send
from ...wire.wire import Header, Msg, encode_json

log = logging.getLogger("bps_gc.server")


class RoundWatch:
    def __init__(self, server):
        self.server = server
        self.failed = set()  # (key, round) already failed
        self.first_seen = {}  # key -> (round, when its first push of that round was seen)
        self.warned = set()  # (key, round) already reported as stalled
        # the loop ticks after every poll; scanning every key each time cost a server more CPU
        # than its sums, so the keys are scanned every quarter timeout (at most 0.25 s)
        self.next_scan = 0.0

    def tensor(self, state):
        return state.decl.get("name", f"key {state.key}")

    def check(self, state):
        """After a push or a departure: fail ``state``'s round if a departed worker owes it."""
        left = self.server.membership.left
        if not left or state.asynchronous or state.arrived == 0 or (state.key, state.round) in self.failed:
            return
        per_host = state.per_host  # two levels: a departed rank's host can no longer push
        owing = sorted(r for r in left if isinstance(r, int) and 0 <= r // per_host < state.workers
                       and not state.pending[r // per_host])
        if not owing:
            return
        self.failed.add((state.key, state.round))
        reason = (f"worker {owing[0]} left the job before pushing tensor {self.tensor(state)!r} "
                  f"(round {state.round}); the round cannot complete")
        log.error("%s", reason)
        payload = encode_json({"message": reason, "job_failed": True})
        for r in range(state.workers):
            if state.pending[r]:
                send(self.server.router, Header(Msg.ERROR, self.server.node_id, key=state.key,
                                                round=state.round), payload, identity=state.identities[r])
        self.server.membership.report_failure(reason)

    def departed(self):
        for state in self.server.keys.values():
            self.check(state)

    def tick(self, stall_timeout):
        now = time.monotonic()
        if now < self.next_scan:
            return
        self.next_scan = now + min(0.25, stall_timeout / 4)
        for key, state in self.server.keys.items():
            if state.asynchronous or state.arrived == 0:
                self.first_seen.pop(key, None)
                continue
            seen = self.first_seen.get(key)
            if seen is None or seen[0] != state.round:
                self.first_seen[key] = (state.round, now)
                continue
            if now - seen[1] >= stall_timeout and (key, state.round) not in self.warned:
                self.warned.add((key, state.round))
                pushed = [r for r in range(state.workers) if state.pending[r]]
                missing = [r for r in range(state.workers) if not state.pending[r]]
                who = "hosts" if state.per_host > 1 else "ranks"  # two levels: one pusher per host
                log.warning("stall: tensor %r (key %d) round %d waited %.0f s: %s %s pushed it, "
                            "%s %s did not", self.tensor(state), key, state.round, now - seen[1],
                            who, pushed, who, missing)
