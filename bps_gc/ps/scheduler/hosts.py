"""The scheduler's view of the worker hosts: DMLC_NUM_WORKER counts hosts, as in BytePS.

Each worker host runs BYTEPS_LOCAL_SIZE local ranks (bpslaunch sets it from
NVIDIA_VISIBLE_DEVICES on the workers only); the scheduler and servers learn it from the
workers' registrations, so they need no BYTEPS_LOCAL_SIZE. A worker's global rank is
DMLC_WORKER_ID * local_size + BYTEPS_LOCAL_RANK. Every host must run the same number of local
ranks and every worker must ask for the same BPS_GC_HIERARCHY: a registration that differs
stops the job at once, naming both hosts. The hierarchy the job runs with ("host": one push per
host of its ranks' shared-memory sum, or "flat": one push per rank) is decided here and sent
in the address book (docs/local_ranks.md).
"""


class WorkerHosts:
    def __init__(self, num_hosts):
        self.num_hosts = num_hosts
        self.first = None  # the first worker's registration: the job's local size and hierarchy
        self.hosts = {}  # worker id -> the address of its first local rank

    @property
    def local_size(self):
        """Local ranks per host; None before a worker joined."""
        return None if self.first is None else self.first["local_size"]

    def expected_workers(self):
        """Worker processes in the job; None before a worker joined (its host tells)."""
        size = self.local_size
        return None if size is None else self.num_hosts * size

    def hierarchy(self):
        """"host" or "flat" (what "auto" means for this job)."""
        if self.first is None or self.local_size == 1:
            return "flat"
        return "flat" if self.first["hierarchy"] == "flat" else "host"

    def check(self, info, rank):
        """(fatal, problem) for a worker's registration: ``fatal`` stops the job (nothing can
        fix it), ``problem`` refuses this worker only; both None when it may join."""
        try:
            worker_id, local_rank = int(info["worker_id"]), int(info.get("local_rank", 0))
            local_size = int(info.get("local_size", 1))
            hierarchy = str(info.get("hierarchy", "auto"))
        except (KeyError, TypeError, ValueError) as e:
            return None, f"a worker registration without a valid worker id or local rank ({e!r})"
        where = str(info.get("host"))
        if not 0 <= worker_id < self.num_hosts:
            return (f"the worker at {where} has DMLC_WORKER_ID={worker_id}, outside [0, {self.num_hosts}) "
                    f"(DMLC_NUM_WORKER={self.num_hosts} counts worker hosts)"), None
        if local_size < 1 or not 0 <= local_rank < local_size or rank != worker_id * local_size + local_rank:
            return None, (f"worker rank {rank} is not DMLC_WORKER_ID * BYTEPS_LOCAL_SIZE + BYTEPS_LOCAL_RANK "
                          f"({worker_id} * {local_size} + {local_rank})")
        if self.first is None:
            self.first = dict(worker_id=worker_id, local_size=local_size, hierarchy=hierarchy, host=where)
        first = self.first
        if local_size != first["local_size"]:
            return (f"worker hosts run different numbers of local ranks: DMLC_WORKER_ID={first['worker_id']} "
                    f"at {first['host']} has BYTEPS_LOCAL_SIZE={first['local_size']}, DMLC_WORKER_ID="
                    f"{worker_id} at {where} has {local_size} (bpslaunch counts NVIDIA_VISIBLE_DEVICES); "
                    f"every worker host must run the same number"), None
        if hierarchy != first["hierarchy"]:
            return (f"workers disagree on BPS_GC_HIERARCHY: DMLC_WORKER_ID={first['worker_id']} at "
                    f"{first['host']} has {first['hierarchy']!r}, DMLC_WORKER_ID={worker_id} at {where} "
                    f"has {hierarchy!r}; every worker must use the same value"), None
        self.hosts.setdefault(worker_id, where)
        return None, None

    def book(self, cfg, workers):
        """What the address book says about the workers' hosts. ``workers``: their Members.
        BPS_GC_LOCAL_REDUCE with every worker on one host keeps its own path (ps/worker/local.py:
        dense sums never reach a server, compressed pushes come from every rank): flat."""
        hierarchy = self.hierarchy()
        if hierarchy == "host" and cfg.local_reduce and not cfg.enable_async and \
                len({m.host for m in workers}) == 1 and all(m.local for m in workers):
            hierarchy = "flat"
        return {"local_size": self.local_size or 1, "hierarchy": hierarchy}


__all__ = ["WorkerHosts"]
