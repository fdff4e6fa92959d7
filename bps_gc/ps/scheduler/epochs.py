"""The scheduler's side of elastic membership (BPS_GC_ELASTIC; docs/elastic.md).

A worker whose heartbeats stop is not a failure of the job: the scheduler opens a new
membership epoch in two steps.

1. PREPARE: every live node hears who left. Servers drop any later push of the dead host;
   workers stop releasing finished round groups and report the last group they released.
2. COMMIT, once every surviving worker reported: the new epoch starts at ``from_group``, one
   past the last group any survivor released. A survivor released a group only with every
   reply of it, each summed with the dead host's push, so the dead host contributed to all of
   that group's keys; no survivor released a later group, so the dead host's pushes to it
   (and to rounds already summed with them) are dropped and those rounds summed again.

A second death before the commit starts the two steps again with a higher epoch. Fewer than
BPS_GC_MIN_WORKERS surviving hosts stops the job, naming the count.
"""
import logging

from ...wire.wire import Msg

log = logging.getLogger("bps_gc.scheduler")


class Epochs:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.epoch = 0
        self.left = []  # worker ranks that left since the last commit
        self.dead = set()  # every worker rank that left
        self.reports = {}  # worker rank -> the last group it released, for the epoch being prepared
        self.preparing = None  # the epoch being prepared, or None

    def members(self):
        return sorted(m.rank for m in self.scheduler.members.values()
                      if m.role == "worker" and not m.gone and not m.joining)

    def host_mates(self, member):
        """The other live local ranks of ``member``'s worker host (rank // local size)."""
        size = self.scheduler.hosts.local_size or 1
        return [m for m in self.scheduler.members.values() if m.role == "worker" and not m.gone
                and not m.joining and m is not member and m.rank // size == member.rank // size]

    def hosts_of(self, ranks):
        """How many worker hosts ``ranks`` are on (BPS_GC_MIN_WORKERS counts hosts)."""
        return len({r // (self.scheduler.hosts.local_size or 1) for r in ranks})

    def worker_died(self, member, reason):
        """``member`` (a worker) is dead: its whole host leaves (a host's local ranks stop
        together: their launcher stops the others), so one epoch drops all its ranks at once,
        whichever of them the heartbeats name first; prepare it, or stop the job below the minimum."""
        log.warning("worker %s (node %s at %s:%s) left: %s", member.rank, member.node_id, member.host,
                    member.port, reason)
        mates = self.host_mates(member)
        if mates:
            log.warning("worker %s leave%s with it: local ranks of the same worker host",
                        ", ".join(str(m.rank) for m in mates), "" if len(mates) > 1 else "s")
        for m in [member, *mates]:
            m.gone = True
            self.left.append(m.rank)
            self.dead.add(m.rank)
            self.scheduler.barrier_waiting.pop(m.identity, None)
        self.left.sort()
        members = self.members()
        minimum = self.scheduler.cfg.min_workers
        count = self.hosts_of(members)
        if count < minimum:
            hosts = f"{count} worker host" + ("" if count == 1 else "s")
            return self.scheduler.fail(None, f"{hosts} left after worker {member.rank} died, fewer than "
                                             f"BPS_GC_MIN_WORKERS={minimum}; the job stops")
        self.preparing = self.epoch + 1 if self.preparing is None else self.preparing + 1
        self.reports = {}
        info = {"epoch": self.preparing, "left": self.left, "members": members, "died": member.rank}
        self.broadcast(Msg.EPOCH_PREPARE, info)
        for m in mates:  # a host-mate still running (its launcher did not stop it) stops, told why
            self.scheduler.reply(m, Msg.EPOCH_PREPARE, obj=info)
        return None

    def report(self, member, info):
        """A survivor's EPOCH_REPORT; the commit goes out once every survivor sent one."""
        if "at" in info:  # a pledge for a join (joins.py)
            return self.scheduler.joins.report(member, info)
        try:
            epoch, released = int(info["epoch"]), int(info["released"])
        except (KeyError, TypeError, ValueError):
            self.scheduler.dropped("a bad epoch report from worker %s", member.rank)
            return
        if epoch != self.preparing or member.role != "worker":
            return  # a report for an epoch superseded by a later death
        self.reports[member.rank] = released
        log.info("worker %s reported for epoch %d: it released round groups up to %d", member.rank, epoch, released)
        members = self.members()
        if not set(members) <= set(self.reports):
            return
        from_group = max(self.reports[r] for r in members) + 1
        self.epoch, self.preparing = self.preparing, None
        info = {"epoch": self.epoch, "left": self.left, "members": members, "from_group": from_group}
        log.warning("membership: worker %s left; epoch %d from round group %d; members %s",
                    ", ".join(map(str, self.left)), self.epoch, from_group, members)
        self.left = []
        self.broadcast(Msg.EPOCH_COMMIT, info)

    def broadcast(self, mtype, info):
        for m in self.scheduler.members.values():
            if not m.gone:
                self.scheduler.reply(m, mtype, obj=info)
