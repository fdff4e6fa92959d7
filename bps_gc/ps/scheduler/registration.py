"""A node's registration, judged before the scheduler acts on it: the fields read from the
untrusted JSON (a malformed one is dropped, never trusted), and whether it stops the job."""
from typing import NamedTuple

from ...wire.wire import decode_json


class Registration(NamedTuple):
    info: dict
    role: str
    rank: int
    host: str
    port: int
    local: str  # the node's ipc endpoint for its host's local ranks, or None
    sums: list  # a server's: the dtypes it adds (an older server's: None, float only)

    @property
    def who(self):
        return f"{self.role} {self.rank} at {self.host}" if self.role == "worker" else f"{self.role} at {self.host}"


def parse(payload):
    """The registration in ``payload``; MalformedMessage, KeyError, TypeError or ValueError for
    one that is not well formed."""
    info = decode_json(payload or b"")
    role, rank = info["role"], int(info["rank"])
    host, port = str(info["host"]), int(info.get("port", 0))
    local = info.get("local")
    if local is not None and not (isinstance(local, str) and local.startswith("ipc://@bps_gc/") and len(local) <= 300):
        raise ValueError(f"local endpoint {local!r}")
    sums = info.get("sums")
    if sums is not None and not (isinstance(sums, list) and len(sums) <= 16 and
                                 all(isinstance(d, str) and len(d) <= 16 for d in sums)):
        raise ValueError(f"sums {sums!r}")
    return Registration(info, role, rank, host, port, local, sums)


def fatal(reg, agreement, members):
    """Why this registration stops the job (None when it may join): a node that could not start,
    settings that disagree with the scheduler's ``agreement``, a worker rank ``members`` has."""
    info = reg.info
    if info.get("error"):
        return f"{reg.who} could not start: {info['error']}"
    agree = info.get("agree")
    if isinstance(agree, dict):
        for variable, mine in agreement.items():
            if agree.get(variable) != mine:
                return (f"{reg.who} has {variable}={agree.get(variable)}, the scheduler "
                        f"{variable}={mine}; every node must use the same value")
    if reg.role == "worker" and any(m.role == "worker" and m.rank == reg.rank for m in members):
        return (f"two workers claim rank {reg.rank}: DMLC_WORKER_ID={info.get('worker_id')} "
                f"(BYTEPS_LOCAL_RANK={info.get('local_rank')}) is used twice, "
                f"the second time by the worker at {info.get('host')}")
    return None
