"""A worker's whole rounds under BPS_GC_ELASTIC (docs/elastic.md).

A *round group* is what a worker starts before it waits: the push_pulls posted since its last
wait() on a handle of the open group (a training step's gradients). Every worker makes the same
calls, so every worker numbers the same groups alike. The replies of a group are held until
all of them are in, then handed to their handles together, the mean dividing by the members
of the group's epoch, and only then does ``size`` change: so a group is never seen half summed
with a host and half without it.

When a host dies, the scheduler's EPOCH_PREPARE freezes the releases and this worker reports
the last group it released; EPOCH_COMMIT says from which group on the new epoch counts. A held
reply of such a group summed under the old epoch (it has the dead host's push) is asked for
again (REDO): the server sums the survivors' pushes of that round, which it still holds.

Two levels (BPS_GC_HIERARCHY=host, host.py): a rank holds the replies of the partitions it
owns (its pushes of the host's sum); the user's handles complete at the copy out of local.py,
after every owner's SUMMED. So the ranks of a host hand a group out together: each tells the
others (a HELD note over the local reduce) once it holds all of the group's replies in the
group's epoch, and releases only when every host-mate said so for that epoch. A group one rank
of a host released is then whole on every rank of it, and, as every partition has an owner on
each host, it had every key summed with the dead host: the scheduler's ``from_group`` argument
holds for hosts as for ranks.

A host joining is joining.py's: members wait at a round group's boundary for it.

``opened`` and ``close`` run on the pushing thread; the rest on the I/O thread.
"""
import collections
import logging
from typing import NamedTuple

from ...comm import NodeFailure
from ...wire.sockets import send
from ...wire.wire import Header, Msg, encode_context, encode_json
from .joining import JoinGate

log = logging.getLogger("bps_gc.worker")


class CloseGroup(NamedTuple):
    """The pushing thread waits on group ``group``, whose push_pulls hold ``partitions`` partitions."""
    group: int
    partitions: int


class Held:
    """A partition's reply held until its group is released."""
    __slots__ = ("push", "payload", "compressed", "seconds", "epoch")

    def __init__(self, push, payload, compressed, seconds, epoch):
        self.push, self.payload, self.compressed = push, payload, compressed
        self.seconds, self.epoch = seconds, epoch


class ElasticRounds:
    def __init__(self, worker, links, membership):
        self.worker, self.links, self.membership = worker, links, membership
        self.rank = worker.rank
        # pushing thread
        self.group = 0  # the open group
        self.posted = 0  # its partitions so far
        # I/O thread
        self.epochs = [(0, 0, worker.size)]  # (epoch, first group, members), by epoch
        self.member_ranks = {0: list(range(worker.size))}  # epoch -> its members' ranks
        self.closed = {}  # group -> its partitions
        self.held = collections.defaultdict(list)  # group -> [Held]
        self.redoing = {}  # key -> the Held awaiting its REDO's reply
        self.released = -1  # groups up to this one were handed out
        self.frozen = False  # an epoch is being prepared: nothing is released
        membership.on_epoch = self.on_epoch
        # two levels: this host's other ranks, and the groups each said it holds (group -> {rank: epoch})
        self.local = worker.host_memory if worker.host is not None else None
        self.mates, self.mates_held, self.told = [], collections.defaultdict(dict), {}
        if self.local is not None:
            self.mates = sorted(self.local.links)
            self.local.on_held = self.mate_held
            self.local.averaged = lambda h: self.worker.size if h.group is None else self.epoch_of(h.group)[1]
        self.gate = JoinGate(worker, self)  # hosts joining; its lock guards group and posted

    # ---------------------------------------------------------------- pushing thread

    def opened(self, handle, partitions):
        with self.gate.cond:
            if self.posted == 0:  # a new group: a host joining may need this worker to wait here
                self.gate.wait_at(self.group)
            handle.group = self.group
            self.posted += partitions

    def close(self, handle, io):
        """``handle`` is waited for: its group, if still open, is complete."""
        with self.gate.cond:
            if handle.group == self.group:
                io.queue(CloseGroup(self.group, self.posted))
                self.group += 1
                self.posted = 0

    # ---------------------------------------------------------------- I/O thread

    def closing(self, command):
        self.closed[command.group] = command.partitions
        self.release()

    def epoch_of(self, group):
        """(epoch, members) the group is summed under, by the commits known so far."""
        epoch, _, members = max(e for e in self.epochs if e[1] <= group)
        return epoch, members

    def replied(self, push, payload, compressed, seconds, epoch):
        if push.handle.group is None:
            push.handle.fail(ValueError(f"{push.handle.tensor.name!r}: BPS_GC_ELASTIC covers push_pull "
                                        "of numpy arrays only for now (docs/elastic.md)"))
            return
        held = Held(push, payload, compressed, seconds, epoch)
        self.held[push.handle.group].append(held)
        self.redo_if_stale(push.handle.group, held)
        self.release()

    def redone(self, header, payload):
        """A reply to a REDO (the key is not in flight); False if it is none."""
        held = self.redoing.get(header.key)
        if held is None or held.push.round != header.round:
            return False
        del self.redoing[header.key]
        held.payload, held.epoch = payload, header.ctx.get("epoch", 0)
        self.redo_if_stale(held.push.handle.group, held)  # summed before a later death's commit came here
        self.release()
        return True

    def redo_if_stale(self, group, held):
        epoch = self.epoch_of(group)[0]
        if held.epoch < epoch and held.push.part.key not in self.redoing:
            self.redoing[held.push.part.key] = held
            part = held.push.part
            send(self.links[part.server], Header(Msg.REDO, self.rank, key=part.key, round=held.push.round,
                                                 context=encode_context({"epoch": epoch})))

    def release(self):
        """Hand out every complete group in order, unless frozen or a reply is not yet right."""
        while not self.frozen:
            group = self.released + 1
            held = self.held.get(group, [])
            if self.closed.get(group) is None or len(held) < self.closed[group]:
                return
            epoch, members = self.epoch_of(group)
            # a reply summed with a dead host's push (its REDO is on the way), or in an epoch
            # whose commit has not come yet
            if any(h.epoch != epoch for h in held) or not self.host_holds(group, epoch):
                return
            self.worker.size = members  # bps.size() changes only here, between groups
            self.worker.epoch = epoch  # and so does bps.membership_epoch()
            self.worker.members = self.member_ranks.get(epoch, self.worker.members)
            for h in held:
                h.push.handle.members = members
                h.push.handle.partition_replied(h.push, h.payload, h.compressed, h.seconds)
            self.held.pop(group, None)
            self.mates_held.pop(group, None)
            self.told.pop(group, None)
            del self.closed[group]
            self.released = group

    def host_holds(self, group, epoch):
        """Whether every rank of this host holds ``group`` summed in ``epoch`` (this one does:
        it tells the others once per epoch); True with one rank per host, or flat."""
        if self.local is None:
            return True
        if self.told.get(group) != epoch:
            self.told[group] = epoch
            self.local.tell_held(group, epoch)
        heard = self.mates_held.get(group, {})
        return all(heard.get(rank) == epoch for rank in self.mates)

    def mate_held(self, rank, group, epoch):
        """A host-mate's HELD note (the local reduce's I/O, this thread)."""
        if group > self.released:
            self.mates_held[group][rank] = epoch
            self.release()

    def on_epoch(self, mtype, info):
        if info.get("joined"):
            return self.gate.on_epoch(mtype, info)
        left = [int(r) for r in info.get("left", [])]
        if self.rank in left:
            died = info.get("died", self.rank)
            if died != self.rank:  # a local rank of this host is silent: the host leaves with it
                raise NodeFailure(f"worker {died}, a local rank of this worker host, left the job (no heartbeat); "
                                  f"the host leaves with it, and worker {self.rank} stops")
            raise NodeFailure(f"the scheduler declared worker {self.rank} dead (no heartbeat); it stops")
        epoch = int(info["epoch"])
        if mtype == Msg.EPOCH_PREPARE:
            self.frozen = True
            self.membership.send(Msg.EPOCH_REPORT, obj={"epoch": epoch, "released": self.released})
            return
        members = [int(r) for r in info["members"]]
        first = int(info["from_group"])
        self.epochs.append((epoch, first, len(members)))
        self.member_ranks[epoch] = members
        log.warning("membership: worker %s left; epoch %d from round group %d; members %s",
                    ", ".join(map(str, left)), epoch, first, members)
        self.frozen = False
        for group, held in self.held.items():
            for h in held:
                self.redo_if_stale(group, h)
        self.release()
