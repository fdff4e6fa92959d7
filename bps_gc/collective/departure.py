"""Ending a job on torch.distributed when ranks leave at different points.

A rank that shuts down (normally, after an exception, or on Ctrl-C) first publishes what it did: how
many collectives it issued (on every rank's group, and on each smaller group it is a member of: the
compressed exchange's pipeline runs on sub-groups) and how many point-to-point messages it sent to
and took from each peer (``Ending``). The other ranks' heartbeat threads read it (liveness.py), so a
rank that waits on a collective or a message the leaver never issued fails at once, naming the
leaver, instead of waiting out gloo's timeout. A wait on a group's collective looks at that group's
members and count only: a rank of another group that leaves is no reason to fail it.

Before blocking on a message (gloo's send/recv complete only inside a blocking wait), a rank writes
what it waits for (``awaiting/<rank>``), so a leaver can see that a peer can never finish.

The end is clean when no rank failed or raised and every two ranks ended with the same collective
counts on each group they share and matching message counts: then the ranks run a last gloo barrier
and destroy the process group, as before. A rank whose script raised (Ctrl-C at every rank
included) may have left others inside a collective bps_gc does not count (FSDP2's own all_gather):
a barrier then would wait on them, and they on it. Otherwise nobody runs collectives again and every rank just goes: closing its sockets
ends any peer blocked on it, and that peer's heartbeat has its Ending by then. The store's host goes
last: once every other rank has ended, died, or is blocked on it and has read its Ending (``seen``).
"""
import time
from dataclasses import dataclass

from ..comm import NodeFailure


@dataclass(frozen=True)
class Ending:
    issued: int        # collectives this rank issued
    sent: tuple        # messages sent to each rank
    received: tuple    # messages taken from each rank
    failed: bool       # it shut down after a failure of the job
    raised: str = None  # the uncaught exception its script ended on (an identifier), if any
    groups: tuple = ()  # ((members, collectives issued on them), ...): its groups smaller than every rank's

    def encode(self):
        groups = ";".join(f"{'-'.join(map(str, members))}:{n}" for members, n in self.groups)
        return "|".join([str(self.issued), ",".join(map(str, self.sent)), ",".join(map(str, self.received)),
                         "failed" if self.failed else "ok", self.raised or "", groups])

    @classmethod
    def decode(cls, text):
        issued, sent, received, how, raised, *rest = (text.decode() if isinstance(text, bytes) else text).split("|")
        groups = tuple((tuple(map(int, members.split("-"))), int(n)) for members, n in
                       (group.split(":") for group in (rest[0].split(";") if rest and rest[0] else [])))
        return cls(int(issued), tuple(map(int, sent.split(","))), tuple(map(int, received.split(","))),
                   how == "failed", raised or None, groups)

    def issued_on(self, members):
        """Its collectives on the group of ``members`` (sorted global ranks; None: every rank's)."""
        return self.issued if members is None else dict(self.groups).get(members, 0)

    def how(self, members=None):
        issued = self.issued_on(members)
        plural = "" if issued == 1 else "s"
        what = "failed" if self.failed else f"its script raised {self.raised}" if self.raised else "shut down"
        on = "" if members is None else f" on the group of ranks {list(members)}"
        return f"{what} after {issued} collective{plural}{on}"


def described(what):
    """``what`` a wait names: a string, or a function making one only when an error needs it."""
    return what() if callable(what) else what


def departure(ended, rank, issued, what, message=None, members=None):
    """The NodeFailure for ``what`` if a rank in ``ended`` ({rank: Ending}) can never complete it,
    else None. ``issued``: this rank's collectives on the group ``what`` runs on, ``members``
    (its sorted global ranks; None: every rank). ``message``: ("recv" | "send", peer, n) for the
    n-th message with ``peer``."""
    leavers = [(other, end) for other, end in list(ended.items())
               if (members is None or other in members) and end.issued_on(members) < issued]
    if leavers:
        other, end = first_leaver(leavers, members)
        return NodeFailure(f"bps_gc: rank {other} left the job ({end.how(members)}) before rank {rank}'s "
                           f"{described(what)}")
    if message is not None:
        kind, peer, n = message
        end = ended.get(peer)
        done = None if end is None else (end.sent if kind == "recv" else end.received)[rank]
        if done is not None and done < n:
            return NodeFailure(f"bps_gc: rank {peer} left the job ({end.how()}, {done} messages "
                               f"{'to' if kind == 'recv' else 'from'} rank {rank}) before rank {rank}'s "
                               f"{described(what)}")
    return None


def first_leaver(leavers, members=None):
    """The (rank, Ending) to name of ``leavers``: a rank that "failed" did so because another
    one left, so the one that did not fail (it raised, got Ctrl-C or ended early), else the
    earliest to leave (fewest collectives on ``members``' group)."""
    return min(leavers, key=lambda leaver: (leaver[1].failed, leaver[1].issued_on(members), leaver[0]))


def matches(mine, rank, other, end):
    shared = {members for members, _ in mine.groups + end.groups if rank in members and other in members}
    return (not end.failed and not end.raised and end.issued == mine.issued and end.sent[rank] == mine.received[other]
            and end.received[rank] == mine.sent[other]
            and all(end.issued_on(members) == mine.issued_on(members) for members in shared))


def blocked_on(heartbeat, mine, other):
    """Whether ``other`` waits for a message this rank (ended as ``mine``) will never send or take."""
    text = heartbeat.awaiting(other)
    if not text:
        return False
    kind, peer, n = text.split()
    me = heartbeat.rank
    return int(peer) == me and int(n) > (mine.sent[other] if kind == "recv" else mine.received[other])


def await_end(heartbeat, mine, hosts_store, limit):
    """After publishing ``mine``: True when every rank ended cleanly (run the last barrier),
    False when the end is not clean (a rank failed, died, or stopped at another point)."""
    rank, size = heartbeat.rank, heartbeat.size
    others = [r for r in range(size) if r != rank]
    clean, deadline = not mine.failed and not mine.raised, time.monotonic() + limit
    while time.monotonic() < deadline:
        if heartbeat.failure is not None:  # a rank died: it will never end
            return False
        ended = dict(heartbeat.ended)
        clean = clean and all(matches(mine, rank, r, e) for r, e in ended.items())
        blocked = [r for r in others if r not in ended and blocked_on(heartbeat, mine, r)]
        clean = clean and not blocked
        if len(ended) == len(others):
            return clean
        if not clean and (not hosts_store or all(r in ended or (r in blocked and heartbeat.seen_by(r))
                                                 for r in others)):
            return False
        time.sleep(heartbeat.interval / 4)
    return False
