"""A worker's side of a host joining an elastic job (BPS_GC_ELASTIC; the scheduler's joins.py,
docs/elastic.md).

Every worker names the arrays a joiner copies with ``elastic_start(params)`` (the script's
parameters, updated in place each step). A member, told a host joins (EPOCH_PREPARE), pledges
the first round group it has not opened and waits before opening it; the COMMIT names the
join's first group, up to which members run, then wait at its boundary (EPOCH_AT). There the
parameters are those every member holds before that step; a donor sends them to each joining
rank (a host of local ranks joins as a unit: each of its ranks from the local rank of the same
number on the lowest member's host, ``donor_of``), with every key's round, over the
worker-to-worker links: a JSON
header, then each array's bytes, never a pickle. The joiner fills its arrays, says EPOCH_AT,
and everyone goes on at GO, once the servers count the joiner.

The joiner's codec state starts at zero: its chains were just built. ``wait_at`` runs on the
pushing thread, under ``cond`` with the group counters of elastic.py; the rest on the I/O thread.
"""
import json
import logging
import threading
import time
from typing import NamedTuple

import numpy as np

from ...comm import NodeFailure
from ...wire.wire import Msg

log = logging.getLogger("bps_gc.worker")
POLL = 0.1  # seconds between looks at the I/O thread's health while waiting


class Tell(NamedTuple):
    """Send ``mtype`` with ``info`` to the scheduler (from the I/O thread)."""
    mtype: object
    info: dict


class JoinGate:
    def __init__(self, worker, rounds):
        self.worker, self.rounds = worker, rounds
        self.cond = threading.Condition()
        self.params = {}  # name -> the script's array
        self.pledge = None  # the group members wait before, until the COMMIT
        self.commit = None  # the COMMIT's info while a join runs
        self.went = threading.Event()  # GO (or a cancelled join) came
        self.at_sent = False
        worker.io.handlers[Tell] = lambda c: rounds.membership.send(c.mtype, obj=c.info)

    # ---------------------------------------------------------------- pushing thread

    def wait_at(self, group):
        """Before opening ``group`` (with ``cond`` held): wait while a join needs this worker here."""
        while self.pledge is not None:
            commit = self.commit
            if commit is None and group < self.pledge or commit is not None and group < commit["from_group"]:
                return
            if commit is not None and not self.at_sent:
                mine = [j for j in commit["joined"] if self.donor_of(commit, j) == self.worker.rank]
                self.send_parameters(commit, mine)
                self.at_sent = True
                self.worker.io.queue(Tell(Msg.EPOCH_AT, {"epoch": commit["epoch"]}))
            self.cond.wait(POLL)
            self.worker.check_alive()

    def donor_of(self, commit, joiner):
        """The member that sends ``joiner`` its parameters and rounds: the local rank of its
        number on the host of the COMMIT's donor (the lowest member; hosts leave and join whole,
        so all its host's ranks are members). A local rank's own tensors (``one_per_host``: its
        part, e.g. DiLoCo's with replicate="hosts") have their rounds on that rank only."""
        size = self.worker.local_size
        return commit["donor"] - commit["donor"] % size + joiner % size

    def send_parameters(self, commit, joiners):
        if not joiners:
            return
        tensors = self.worker.tensors
        params = self.params() if callable(self.params) else self.params
        header = {"arrays": [[name, str(a.dtype), list(a.shape)] for name, a in params.items()],
                  "rounds": {name: self.rounds_of(t) for name, t in tensors.items() if t.partitions and not t.local}}
        channel = f"bps_gc.join.{commit['epoch']}"
        peers = self.worker.peers
        for joiner in joiners:
            peers.send(joiner, channel, json.dumps(header).encode())
            for array in params.values():
                peers.send(joiner, channel, np.ascontiguousarray(array))

    def rounds_of(self, tensor):
        """Each partition's round at the join's boundary: two levels count the replies of the
        partitions this rank owns only, but the host's rounds of the tensor started, all done
        here, are every partition's."""
        host, memory = self.worker.host, self.worker.host_memory
        if host is not None and host.carries(tensor):
            local = memory.by_name.get(tensor.name)
            return [local.rounds if local is not None else 0] * len(tensor.partitions)
        return [p.round for p in tensor.partitions]

    def join(self):
        """The joiner: once the servers accepted its declarations, ask to join and wait for the
        parameters and GO; returns the first round group (step) it takes part in."""
        flight = self.worker.io.flight
        self.worker.io.wait_declared(self.worker.check_alive)
        if flight.failed_keys:
            problem = next(iter(flight.failed_keys.values()))
            raise NodeFailure(f"worker {self.worker.rank} cannot join the running job: {problem}")
        self.worker.io.queue(Tell(Msg.JOIN_READY, {}))
        while self.commit is None:
            self.worker.check_alive()
            time.sleep(0.01)
        commit = self.commit
        self.receive_parameters(commit)
        self.worker.io.queue(Tell(Msg.EPOCH_AT, {"epoch": commit["epoch"]}))
        while not self.went.wait(POLL):
            self.worker.check_alive()
        return commit["from_group"]

    def receive_parameters(self, commit):
        channel, peers = f"bps_gc.join.{commit['epoch']}", self.worker.peers
        donor = self.donor_of(commit, self.worker.rank)
        header = json.loads(bytes(peers.recv(donor, channel, self.worker.cfg.join_timeout)).decode())
        arrays = header.get("arrays", [])
        params = self.params(arrays) if callable(self.params) else self.params
        if [name for name, _, _ in arrays] != list(params):
            raise NodeFailure(f"worker {self.worker.rank} cannot join the running job: the job's parameters "
                             f"are {[a[0] for a in arrays]}, this worker's {list(params)}")
        for name, dtype, shape in arrays:
            data = peers.recv(donor, channel, self.worker.cfg.join_timeout)
            mine = params[name]
            if str(mine.dtype) != dtype or list(mine.shape) != shape or data.nbytes != mine.nbytes:
                raise ValueError(f"parameter {name!r}: the job's is {dtype}{shape}, this worker's "
                                 f"{mine.dtype}{list(mine.shape)}")
            np.copyto(mine, data.view(mine.dtype).reshape(mine.shape))
        for name, rounds in header.get("rounds", {}).items():
            tensor = self.worker.tensors.get(name)
            if tensor is not None and len(tensor.partitions) == len(rounds):
                for part, r in zip(tensor.partitions, rounds):
                    part.round = int(r)

    # ---------------------------------------------------------------- I/O thread

    def on_epoch(self, mtype, info):
        joined = [int(r) for r in info["joined"]]
        me = self.worker.rank in joined
        with self.cond:
            if mtype == Msg.EPOCH_PREPARE and not me:
                self.pledge, self.commit, self.at_sent = self.rounds.group + (1 if self.rounds.posted else 0), None, False
                self.went.clear()
                self.rounds.membership.send(Msg.EPOCH_REPORT, obj={"epoch": int(info["epoch"]), "at": self.pledge})
            elif mtype == Msg.EPOCH_COMMIT:
                for r in joined:  # the joiners' links, at their new addresses
                    self.worker.peers.renew(r, info["addresses"][str(r)])
                self.commit = dict(info, from_group=int(info["from_group"]), epoch=int(info["epoch"]))
            elif mtype == Msg.EPOCH_GO:
                self.went_on(info, me)
            self.cond.notify_all()

    def went_on(self, info, me):
        if not info.get("cancelled"):
            first, members = int(info["from_group"]), [int(r) for r in info["members"]]
            rounds = self.rounds
            if me:  # its groups are numbered from the join's first on
                rounds.group, rounds.posted, rounds.released = first, 0, first - 1
                rounds.epochs = []
            rounds.epochs.append((int(info["epoch"]), first, len(members)))
            rounds.member_ranks[int(info["epoch"])] = members
            if me:  # the joiner's script sees the job it joins before its first step
                self.worker.size, self.worker.epoch, self.worker.members = len(members), int(info["epoch"]), members
            log.warning("membership: worker %s joined; epoch %s from round group %d; members %s",
                        ", ".join(map(str, info["joined"])), info["epoch"], first, members)
            rounds.release()
        else:
            log.warning("membership: worker %s did not join: %s", info["joined"], info.get("why", "cancelled"))
        self.pledge, self.commit = None, None
        self.went.set()
