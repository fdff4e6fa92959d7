"""Splitting this host's CPUs between local ranks (BYTEPS_NUMA_ON).

BytePS bound each rank to a share of the cores and crashed on small hosts; here a host with
fewer CPUs than ranks (or without affinity support) just runs its ranks unbound.
"""
import glob
import os

SYSFS_CPU = "/sys/devices/system/cpu"


def plan_cpus(ranks, numa_on, say):
    """One CPU set (or None: unbound) per rank.

    numa_on: True (asked for: say why when it cannot apply), None (unset: bind silently where
    it applies), False (off).
    """
    unbound = [None] * ranks
    if numa_on is False or ranks < 2:  # one rank bound to all our CPUs is no binding at all
        return unbound
    if not (hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")):
        if numa_on:
            say("BYTEPS_NUMA_ON: CPU affinity is not supported here; running unbound")
        return unbound
    available = os.sched_getaffinity(0)
    slices = cpu_slices(ranks, available)
    if slices is None:
        if numa_on:
            say(f"BYTEPS_NUMA_ON: {len(available)} CPUs for {ranks} local ranks; running unbound")
        return unbound
    return slices


def cpu_slices(ranks, cpus, sort_key=None):
    """Disjoint, contiguous (in topology order) CPU sets, one per rank; None if too few CPUs."""
    if len(cpus) < ranks:
        return None
    ordered = sorted(cpus, key=sort_key or topology_key)
    share, extra = divmod(len(ordered), ranks)
    slices, start = [], 0
    for rank in range(ranks):
        size = share + (1 if rank < extra else 0)
        slices.append(set(ordered[start:start + size]))
        start += size
    return slices


def topology_key(cpu):
    """Sort key that keeps a socket's, a NUMA node's and a core's hyperthreads together."""
    base = os.path.join(SYSFS_CPU, f"cpu{cpu}")
    nodes = glob.glob(os.path.join(base, "node[0-9]*"))
    node = int(os.path.basename(nodes[0])[4:]) if nodes else 0
    return (_read_int(os.path.join(base, "topology", "physical_package_id")), node,
            _read_int(os.path.join(base, "topology", "core_id")), cpu)


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0
