"""A worker host joins a running elastic job (BPS_GC_ELASTIC; docs/elastic.md).

A worker started with the job's variables and the DMLC_WORKER_ID of a host that left registers
while the job runs. Settings that differ from the job's refuse it in one line naming both; the
job goes on. Otherwise it gets an address book and declares its tensors (a server refuses a
declaration unlike the job's, naming both), then says JOIN_READY. A host of several local ranks
joins as a unit: its ranks register one by one, and the join starts once every one of them
said JOIN_READY; under two levels (BPS_GC_HIERARCHY=host) its ranks get their address book
only once all of them registered, as each needs its host-mates' local reduce endpoints (the
scheduler stands in for their heartbeats until then). The whole join, from the host's first
registration to GO, is bounded by BPS_GC_JOIN_TIMEOUT (the scheduler's or the joining ranks',
the shorter): past it the join is cancelled, naming what it still waits for (a local rank that
never registered), and the job goes on. Three steps follow:

1. PREPARE: every member pledges the first round group it has not opened yet and waits there.
2. COMMIT: the join starts at ``from_group``, the highest pledge; members run up to it and wait
   at its boundary (EPOCH_AT). A live member (the donor; a host of local ranks: each joining
   rank's counterpart on the donor's host, joining.py) sends each joining rank the parameters
   and every key's round; each says EPOCH_AT once it has them.
3. GO: with every member at the boundary no round is open, so the servers count the joiner from
   each key's next round; once every server echoed GO, the workers hear it and go on.
"""
import logging
import time

from ...wire.wire import Msg

log = logging.getLogger("bps_gc.scheduler")


class Joins:
    def __init__(self, scheduler, epochs):
        self.scheduler, self.epochs = scheduler, epochs
        self.joiners = []  # the Members (local ranks of one host) joining now, as they register
        self.unbooked = []  # two levels: those of them awaiting their address book
        self.ready_ranks = set()  # those of them that said JOIN_READY
        self.step = None  # "prepare", "commit" or "go" while a join runs
        self.pledges, self.at, self.servers_go = {}, set(), set()
        self.from_group = None
        self.ended = None  # why no host may join any more: a member said goodbye, the job is ending
        self.since, self.bound = None, None  # the host's first registration; seconds it has to reach GO

    def register(self, identity, info, role, rank, host, port, local, who):
        """A registration once the job runs: a worker taking a departed host's place, or refused."""
        s = self.scheduler
        problem, size = None, s.hosts.local_size or 1
        if role != "worker":
            problem = "the cluster is already complete (only a worker host may join a running job)"
        elif self.ended:
            problem = self.ended
        elif rank not in self.epochs.dead:
            problem = (f"worker rank {rank} is a member of the running job; a joining host takes the "
                       f"DMLC_WORKER_ID of one that left ({sorted(self.epochs.dead) or 'none left'})")
        elif any(j.rank == rank for j in self.joiners):
            problem = f"worker {rank} is joining already; start it again once that join ended"
        elif self.epochs.preparing is not None or self.joiners and (
                self.step is not None or rank // size != self.joiners[0].rank // size):  # not a host-mate
            problem = "another membership change is under way; start it again in a moment"
        else:
            agree = info.get("agree") if isinstance(info.get("agree"), dict) else {}
            for variable, mine in s.cfg.agreement().items():
                if agree.get(variable) != mine:
                    problem = f"it has {variable}={agree.get(variable)}, the job {variable}={mine}"
                    break
            if problem is None and int(info.get("local_size", 1)) != (s.hosts.local_size or 1):
                problem = (f"it has BYTEPS_LOCAL_SIZE={info.get('local_size')}, the job "
                           f"{s.hosts.local_size}")
            if problem is None and s.hosts.first and info.get("hierarchy") != s.hosts.first["hierarchy"]:
                problem = f"it has BPS_GC_HIERARCHY={info.get('hierarchy')}, the job {s.hosts.first['hierarchy']}"
        if problem:
            log.error("refused %s joining the running job: %s", who, problem)
            return s.refuse(identity, f"{who} cannot join the running job: {problem}")
        old = next(i for i, m in s.members.items() if m.role == "worker" and m.rank == rank)
        member = type(s.members[old])(identity, role, rank, host, port, local)
        member.node_id, member.joining = s.members.pop(old).node_id, True
        s.members[identity] = member
        if not self.joiners:
            self.since, self.bound = time.monotonic(), s.join_timeout
        self.bound = min(self.bound, joiner_bound(info, self.bound))
        self.joiners.append(member)
        log.info("worker %d at %s:%s asks to join the running job", rank, host, port)
        if s.hosts.hierarchy() == "host":  # two levels: the books once every local rank registered
            self.unbooked.append(member)
            if len(self.joiners) == size:
                self.send_books(self.unbooked)
                self.unbooked = []
        else:
            self.send_books([member])
        return None

    def send_books(self, joiners):
        s = self.scheduler
        servers = [m for m in s.members.values() if m.role == "server"]
        workers = sorted((m for m in s.members.values() if m.role == "worker" and not m.gone), key=lambda m: m.rank)
        for member in joiners:
            book = {"servers": [m.describe() for m in sorted(servers, key=lambda m: m.rank)],
                    "workers": [m.describe() for m in workers], **s.hosts.book(s.cfg, workers),
                    "you": member.node_id, "rank": member.rank, "joining": True}
            s.reply(member, Msg.ADDRESS_BOOK, obj=book)

    def left(self, member, reason):
        """A joining rank went away before it was admitted: the job goes on as it was, and its
        host-mates joining with it are refused (their launcher stops them)."""
        if member not in self.joiners:  # one whose join was cancelled, saying goodbye
            member.gone = True
            return
        log.warning("worker %d left before it was admitted (%s); the job goes on", member.rank, reason)
        member.gone = True
        for mate in self.joiners:
            if mate is not member:
                log.warning("worker %d's join is cancelled: worker %d, a local rank of its host, left", mate.rank,
                            member.rank)
                self.scheduler.refuse(mate.identity, f"worker {mate.rank} cannot join the running job now: worker "
                                                     f"{member.rank}, a local rank of its host, left; start the host again")
                mate.gone = True
        if self.step is not None:  # members waiting at a pledge or the boundary go on
            self.broadcast(Msg.EPOCH_GO, dict(self.go_info(cancelled=True), why=f"it left: {reason}"), servers=False)
            self.epochs.preparing = None
        self.reset()

    def reset(self):
        self.joiners, self.ready_ranks, self.step, self.unbooked = [], set(), None, []

    def overdue(self, now):
        """A join not at GO within its bound is cancelled (a local rank that never registers
        sends no heartbeat to miss; a stalled step would hold the members at their boundary)."""
        for member in self.unbooked:  # no book yet, so no heartbeat: the join's bound covers it
            member.last_seen = now
        if self.joiners and self.step != "go" and now - self.since > self.bound:
            self.cancel(f"{self.awaited()} within BPS_GC_JOIN_TIMEOUT={self.bound:g} s of the host's first "
                        f"registration")

    def awaited(self):
        """What the join waits for, in words."""
        size = self.scheduler.hosts.local_size or 1
        base = self.joiners[0].rank // size * size
        registered = {j.rank for j in self.joiners}
        if self.step is None:
            missing = [r for r in range(base, base + size) if r not in registered]
            if missing:
                return f"its host's {local_ranks(missing, size)} did not register"
            waiting = sorted(registered - self.ready_ranks)
            return (f"its host's {local_ranks(waiting, size)} did not get {'their' if len(waiting) > 1 else 'its'} "
                    f"declarations accepted by the servers")
        if self.step == "prepare":
            return f"member worker(s) {sorted(set(self.epochs.members()) - set(self.pledges))} did not pledge"
        absent = sorted((set(self.epochs.members()) | registered) - self.at)
        return f"worker(s) {absent} did not reach the join's boundary"

    def cancel(self, problem, again=True):
        """Another membership change (a death) comes before the join reached GO, or its bound
        passed (overdue): the members go on as they were, the joiner is refused (it may start
        again, unless ``again`` is False: the job ends), and a change goes on alone. At GO the
        servers count the joiner already: deaths wait for the join's end then."""
        for j in self.joiners:
            log.warning("worker %d's join is cancelled: %s%s", j.rank, problem, "; the job goes on" if again else "")
            self.scheduler.refuse(j.identity, f"worker {j.rank} cannot join the running job now: {problem}"
                                              + ("; start it again" if again else ""))
            j.gone = True  # told by the refusal alone
        if self.step is not None:
            self.broadcast(Msg.EPOCH_GO, dict(self.go_info(cancelled=True), why=problem), servers=False)
            self.epochs.preparing = None
        self.reset()

    def ending(self, member):
        """A member said goodbye: it finished, so the job is ending (elsewhere a member's goodbye
        while others run fails the rounds that need it, watch.py). A join under way can never
        complete, as the member will not reach its boundary (nor send the parameters): it is
        refused now, and so is any later one, else the joiner and the servers wait forever.
        At GO every member waits at the boundary, so none says goodbye then."""
        if self.ended is None:
            self.ended = f"the job is ending (worker {member.rank} said goodbye)"
        if self.joiners and self.step != "go":
            self.cancel(self.ended, again=False)

    def ready(self, member):
        if member not in self.joiners or self.step is not None:
            return
        self.ready_ranks.add(member.rank)
        if len(self.ready_ranks) < (self.scheduler.hosts.local_size or 1):  # its host-mates come
            return
        if self.epochs.preparing is not None:  # a death's epoch is being prepared
            return self.cancel("another membership change is under way")
        self.epochs.preparing = self.epochs.epoch + 1
        self.step, self.pledges, self.at, self.servers_go = "prepare", {}, set(), set()
        self.broadcast(Msg.EPOCH_PREPARE, {"epoch": self.epochs.preparing, "joined": self.ranks(), "left": [],
                                           "members": self.epochs.members()}, servers=False)

    def report(self, member, info):
        """A member's pledge (EPOCH_REPORT with "at")."""
        if self.step != "prepare" or int(info.get("epoch", -1)) != self.epochs.preparing:
            return
        self.pledges[member.rank] = int(info["at"])
        members = self.epochs.members()
        if set(members) <= set(self.pledges):
            self.step, self.from_group = "commit", max(self.pledges[r] for r in members)
            log.info("the join of worker %s starts at round group %d: the members run up to it",
                     ", ".join(map(str, self.ranks())), self.from_group)
            self.broadcast(Msg.EPOCH_COMMIT, dict(self.go_info(), donor=members[0], addresses={
                str(j.rank): f"{j.host}:{j.port}" for j in self.joiners}), servers=False)

    def arrived(self, member, info):
        """EPOCH_AT from a member or the joiner; EPOCH_GO echoed by a server."""
        if self.step not in ("commit", "go") or int(info.get("epoch", -1)) != self.epochs.preparing:
            return
        if member.role == "server":
            self.servers_go.add(member.rank)
        else:
            self.at.add(member.rank)
        everyone = set(self.epochs.members()) | set(self.ranks())
        if self.step == "commit" and everyone <= self.at:
            self.step = "go"
            for j in self.joiners:
                j.joining = False  # a member from now: the servers count it
            self.broadcast(Msg.EPOCH_GO, self.go_info(), workers=False)
        elif self.step == "go" and len(self.servers_go) == self.scheduler.cfg.num_server:
            info = self.go_info()
            self.epochs.epoch, self.epochs.preparing = self.epochs.preparing, None
            self.epochs.dead -= set(self.ranks())
            log.warning("membership: worker %s joined; epoch %d from round group %d; members %s",
                        ", ".join(map(str, self.ranks())), self.epochs.epoch, self.from_group, self.epochs.members())
            self.broadcast(Msg.EPOCH_GO, info, servers=False)
            self.reset()

    def ranks(self):
        return sorted(j.rank for j in self.joiners)

    def go_info(self, cancelled=False):
        members = sorted(set(self.epochs.members()) | (set(self.ranks()) if not cancelled else set()))
        return {"epoch": self.epochs.preparing, "joined": self.ranks(), "members": members,
                "from_group": self.from_group, "cancelled": cancelled}

    def broadcast(self, mtype, info, servers=True, workers=True):
        for m in self.scheduler.members.values():
            if not m.gone and ((m.role == "server" and servers) or (m.role == "worker" and workers)):
                self.scheduler.reply(m, mtype, obj=info)


def joiner_bound(info, default):
    """The BPS_GC_JOIN_TIMEOUT a joining rank registered with (untrusted: ``default`` unless a
    positive number)."""
    value = info.get("join_timeout")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else default


def local_ranks(ranks, size):
    """'local rank 1 (worker 3)' / 'local ranks 0, 1 (workers 2, 3)'."""
    plural = "s" if len(ranks) > 1 else ""
    return (f"local rank{plural} {', '.join(str(r % size) for r in ranks)} "
            f"(worker{plural} {', '.join(map(str, ranks))})")


__all__ = ["Joins"]
