"""The host level's memory work alone (issue 25's "host-level floor"), for bench_pushpull.py.

M machines x L ranks as processes on this box, all at once (as the benchmark's ranks share its
cores), each rank with its own input of the benchmark's bytes and its own output. One round,
from a start common to every rank: each rank copies its input into its slot of its host's shared
memory; the host's ranks wait for each other; each sums its share (an L-th) over the host's
slots in local-rank order into the host's result (comm/host_sum.add_in_order, the code both
transports' two levels use); they wait again; each copies the whole result out into its output,
divided by the ranks (averaging). No codec, no network, no messages: the copy in, sum and copy
out that two levels cannot avoid, timed with numpy on the same cores. A round's time is its
slowest rank's; the row is the median over the timed rounds.

Shared memory is an anonymous shared mapping made before the ranks are forked (nothing in
/dev/shm; freed with the last process). The ranks wait on multiprocessing barriers (futexes,
no polling).
"""
import mmap
import multiprocessing
import os
import statistics
import time

import numpy as np

from bps_gc.comm.host_sum import add_in_order

BARRIER_TIMEOUT = 120.0  # seconds: a rank that died breaks its peers' barriers instead of hanging them


def _rank(memory, n, local_size, local_rank, rank, ranks, host_barrier, all_barrier, rounds, results):
    """One rank's rounds; puts (rank, [seconds per round]) on ``results``."""
    slots = np.frombuffer(memory, np.float32, local_size * n).reshape(local_size, n)
    result = np.frombuffer(memory, np.float32, n, offset=local_size * n * 4)
    source = np.random.default_rng(rank).standard_normal(n, dtype=np.float32)
    output = np.zeros(n, np.float32)  # the caller's array: its pages exist before the first round
    step = -(-n // local_size)
    mine = slice(local_rank * step, min(n, (local_rank + 1) * step))
    divisor, seconds = np.float32(ranks), []
    for _ in range(rounds):
        all_barrier.wait()
        start = time.perf_counter()
        np.copyto(slots[local_rank], source)
        host_barrier.wait()
        add_in_order([slot[mine] for slot in slots], result[mine])
        host_barrier.wait()
        np.divide(result, divisor, out=output)
        seconds.append(time.perf_counter() - start)
    results.put((rank, seconds))


def measure_host_floor(machines, local_ranks, elements, rounds, warmup):
    """{"seconds", "min", "max", "rounds": [...], ...}: the host level's memory work per round
    (see the module's note) for ``machines`` x ``local_ranks`` ranks of ``elements`` float32;
    None (saying why) where it would need more than half of this box's free memory."""
    ranks = machines * local_ranks
    needed = (machines * (local_ranks + 1) + 2 * ranks) * elements * 4  # shared, inputs, outputs
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > free / 2:
        print(f"host-level floor skipped: it needs {needed / 1e9:.1f} GB, this box has "
              f"{free / 1e9:.1f} GB free", flush=True)
        return None
    ctx = multiprocessing.get_context("fork")  # the shared mappings travel by fork
    total = warmup + rounds
    all_barrier = ctx.Barrier(ranks, timeout=BARRIER_TIMEOUT)
    results, procs = ctx.Queue(), []
    # Every host's barrier stays referenced here until the end: a barrier's state lives in
    # multiprocessing's shared heap, and a block the parent frees is handed to the next barrier
    # made, which would then share its state with the first host's ranks (3 hosts hung so).
    host_barriers = []
    try:
        for host in range(machines):
            memory = mmap.mmap(-1, (local_ranks + 1) * elements * 4)  # L slots and the result
            host_barrier = ctx.Barrier(local_ranks, timeout=BARRIER_TIMEOUT)
            host_barriers.append(host_barrier)
            for local_rank in range(local_ranks):
                rank = host * local_ranks + local_rank
                proc = ctx.Process(target=_rank, daemon=True, name=f"host-floor-{rank}",
                                   args=(memory, elements, local_ranks, local_rank, rank, ranks,
                                         host_barrier, all_barrier, total, results))
                proc.start()
                procs.append(proc)
            memory.close()  # the children hold it now
        got = {}
        deadline = time.monotonic() + BARRIER_TIMEOUT + 60
        while len(got) < ranks:
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"host-level floor: a rank failed or hung "
                                   f"(exit codes {[p.exitcode for p in procs]})")
            try:
                rank, seconds = results.get(timeout=1.0)
            except Exception:  # queue.Empty: check the ranks again
                continue
            got[rank] = seconds
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    per_round = [max(got[r][k] for r in range(ranks)) for k in range(warmup, total)]
    return {"system": "host level", "config": "floor: copy in, sum, copy out",
            "topology": f"{machines} machines x {local_ranks} ranks, numpy, no network",
            "seconds": statistics.median(per_round), "min": min(per_round), "max": max(per_round),
            "rounds": per_round, "machines": machines, "local_ranks": local_ranks,
            "bytes": elements * 4, "host_floor": True}


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machines", type=int, default=2)
    p.add_argument("--local-ranks", type=int, default=4)
    p.add_argument("--tensor-mb", type=float, default=25.6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()
    row = measure_host_floor(a.machines, a.local_ranks, int(round(a.tensor_mb * 1e6 / 4)), a.rounds, a.warmup)
    if row is not None:
        print(f"host-level floor, {row['topology']}, {row['bytes'] / 1e6:.1f} MB: {row['seconds']:.4f} s/round "
              f"(min {row['min']:.4f}, max {row['max']:.4f})")
