"""A server's rounds under BPS_GC_ELASTIC (docs/elastic.md).

* EPOCH_PREPARE: pushes of the dead hosts are dropped from then on (they may be alive but
  silent); rounds they already pushed still complete with them, under the old epoch.
* EPOCH_COMMIT: each key's rounds count the members' pushes; a dead host's push waiting in an
  open round is dropped (no open round belongs to a group any survivor released: see the
  scheduler's epochs.py), and a round every member has now pushed completes.
* REDO (a survivor holds a reply summed with a dead host's push, of a group the new epoch
  counts): the key goes back to that round, and once every member asked, the round is summed
  again from the members' pushes, still in their receive buffers (no member pushed the key
  since: it holds the reply), the reducer's state first put back as it was before the round.
* EPOCH_GO (a host joins, docs/elastic.md): every member waits at the join's first round group,
  so no round is open; the joiner (which took a departed host's rank, whose declarations were
  accepted while it was still fenced from pushing) counts from each key's next round. The
  server echoes GO to the scheduler, which only then lets the workers go on.
* Every reply of epoch e > 0 carries {"epoch": e} in its context, so a worker knows which
  members a sum holds.
* Two levels (BPS_GC_HIERARCHY=host): a key's pushers are hosts (one push of the host's sum,
  from the partition's owner local rank), so rounds count member *hosts* (``pushers``), a dead
  host's push is dropped by its slot, and the owner asks for the REDO.
"""
import logging

from ...wire.sockets import MalformedMessage
from ...wire.wire import Msg

log = logging.getLogger("bps_gc.server")


class ServerRounds:
    def __init__(self, server):
        self.server = server
        self.epoch = 0
        self.members = None  # worker ranks of the current epoch; None: all
        self.fenced = set()  # ranks whose pushes are dropped
        self.early = []  # REDOs that came before this server's commit of their epoch
        server.membership.on_epoch = self.on_epoch

    def admit(self, rank, mtype=None):
        """A departed host's messages are dropped, but for a joiner's declarations (INIT)."""
        if rank in self.fenced and mtype != Msg.INIT:
            raise MalformedMessage(f"a message from worker {rank}, which left the job")

    def declared(self, state):
        """A key declared after a commit counts the current members."""
        state.elastic, state.epoch = True, self.epoch
        if self.members is not None:
            state.expected = pushers(state, self.members)

    def on_epoch(self, mtype, info):
        if mtype == Msg.EPOCH_GO:
            return self.joined(info)
        left = {int(r) for r in info.get("left", [])}
        self.fenced |= left
        if mtype == Msg.EPOCH_PREPARE:
            return
        self.epoch, self.members = int(info["epoch"]), [int(r) for r in info["members"]]
        log.warning("membership: worker %s left; epoch %d from round group %s; members %s",
                    ", ".join(map(str, sorted(left))), self.epoch, info.get("from_group"), self.members)
        for state in self.server.keys.values():
            state.epoch, state.expected = self.epoch, pushers(state, self.members)
            for slot in {state.slot(rank) for rank in left}:
                if state.pending[slot]:
                    state.pending[slot] = False
                    state.arrived -= 1
            self.complete_if_due(state)
        early, self.early = self.early, []
        for rank, header in early:
            self.redo(rank, header)

    def joined(self, info):
        joined = [int(r) for r in info["joined"]]
        self.epoch, self.members = int(info["epoch"]), [int(r) for r in info["members"]]
        self.fenced -= set(joined)
        for state in self.server.keys.values():
            if state.arrived:  # cannot be: every member waits at the join's first group
                log.error("key %d: round %d is open while worker %s joins", state.key, state.round, joined)
            state.epoch, state.expected = self.epoch, pushers(state, self.members)
        log.warning("membership: worker %s joined; epoch %d from round group %s; members %s",
                    ", ".join(map(str, joined)), self.epoch, info.get("from_group"), self.members)
        self.server.membership.send(Msg.EPOCH_GO, obj={"epoch": self.epoch})

    def complete_if_due(self, state):
        if state.arrived and state.arrived == state.expected:
            state.engine.submit([state.take_round()], self.server.node_id)

    def redo(self, rank, header):
        """Worker ``rank`` asks for round ``header.round`` of ``header.key`` again."""
        self.admit(rank)
        if header.ctx.get("epoch", 0) > self.epoch:
            self.early.append((rank, header))  # its commit is still on its way here
            return
        state = self.server.keys.get(header.key)
        if state is None:
            raise MalformedMessage(f"REDO of undeclared key {header.key}")
        if state.round == header.round + 1 and state.arrived == 0:
            state.round, state.redo = header.round, True  # back to the round to sum again
            log.info("key %d: round %d is summed again over epoch %d's members", header.key,
                     header.round, self.epoch)
        slot = state.slot(rank)
        if state.round != header.round or not state.redo or state.pending[slot]:
            raise MalformedMessage(f"REDO of key {header.key} round {header.round} from worker {rank}: "
                                   f"the key is at round {state.round}")
        state.pending[slot] = True
        state.arrived += 1
        self.complete_if_due(state)


def pushers(state, members):
    """The pushes that complete a round of ``state`` among worker ranks ``members``: one per
    member rank, or per member host where the key is pushed once per host (two levels)."""
    return len({state.slot(rank) for rank in members})


def before_compute(state, job, codecs):
    """On the engine thread, before a round of an elastic key is summed: keep the reducer's
    state (a redo starts from it), or put it back for a redo."""
    if state.reducer is None:
        return
    if job.redo:
        state.reducer.load_state_dict(codecs.decode_state(state.snapshot))
    else:
        state.snapshot = codecs.encode_state(state.reducer.state_dict())
