#!/usr/bin/env python3
"""BytePS's recipe at its full shape (../shared/seeds/003_*.txt: 8 p3 hosts x 8 GPUs, 16
servers), on this machine: each host a network namespace on a shaped switch
(scripts/netns.py SwitchedMachines), one `bpslaunch` per role with the recipe's environment
as written, and every rank's averages checked bit for bit against numpy.

The environments (RECIPE_*): the scheduler's and servers' `DMLC_NUM_WORKER` = hosts,
`DMLC_NUM_SERVER` = servers, no `BYTEPS_LOCAL_SIZE`; the workers' `NVIDIA_VISIBLE_DEVICES=0..L-1`
(bpslaunch starts one rank per entry), `DMLC_WORKER_ID` = the host, `BYTEPS_PARTITION_BYTES`,
`BYTEPS_MIN_COMPRESS_BYTES`, `BYTEPS_NUMA_ON=1`, the OMP settings and BYTEPS_THREADPOOL_SIZE.
(The recipe's worker.sh carries a one-host template's DMLC_NUM_WORKER=1 and DMLC_NUM_SERVER=2;
on 8 hosts its workers get the scheduler's 8 and 16.) The script adds only what this machine
needs: the port of a fresh namespace, BPS_GC_JOIN_TIMEOUT and BPS_GC_HEARTBEAT_TIMEOUT long
enough for 64 workers, 16 servers and a scheduler to start on 2 shared cores (HARNESS_ENV).
Server s runs on host s mod hosts (two per host at full shape: co-located, as BytePS does).

Each rank push_pulls small tensors (TENSORS: sizes that place them on different servers and
owners) for --steps rounds, half averaged, half summed; inputs are small integers, so every
order of summation gives the same float32 sum and numpy's expectation is exact: the sum of
all ranks' inputs, divided by float32(ranks) for an average. Each host's ranks together must
also have sent their servers one copy of every tensor per step (bps.metrics().pushed_wire):
the recipe's environment runs two levels, not every rank pushing its own copy. Exit status 1
on any mismatch or failed process, naming it; 0 when every rank got every value.

    sudo python scripts/recipe_shape.py                                # 8 x 8, 16 servers
    sudo python scripts/recipe_shape.py --hosts 3 --local-ranks 4 --servers 6
"""
import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import PY, ROOT, import_netns, interrupt_on_signals, machine_info, tear_down, write_json_atomic  # noqa: E402  (puts this checkout first)

SCRIPT = os.path.abspath(__file__)
PORT = 1234  # the recipe's DMLC_PS_ROOT_PORT (each namespace is fresh: nothing else listens)
RECIPE_SCHEDULER = {"DMLC_ROLE": "scheduler", "BYTEPS_LOG_LEVEL": "WARNING"}
RECIPE_SERVER = {"DMLC_ROLE": "server", "OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE",
                 "BYTEPS_LOG_LEVEL": "WARNING"}
RECIPE_WORKER = {"DMLC_ROLE": "worker", "BYTEPS_LOG_LEVEL": "WARNING", "OMP_WAIT_POLICY": "PASSIVE",
                 "OMP_NUM_THREADS": "4", "BYTEPS_THREADPOOL_SIZE": "16", "BYTEPS_PARTITION_BYTES": "4096000",
                 "BYTEPS_MIN_COMPRESS_BYTES": "1024000", "BYTEPS_NUMA_ON": "1"}
# sizes (elements) of the tensors every rank push_pulls: tiny, many, so they land on every
# server and every local rank owns some
TENSORS = [1, 3, 8, 17, 64, 100, 255, 256, 257, 500, 1000, 1023, 1024, 2049, 3000, 4096, 5, 77, 640, 999]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=8, help="worker hosts (namespaces) (8)")
    p.add_argument("--local-ranks", "--local-size", type=int, default=8,
                   help="ranks per host: NVIDIA_VISIBLE_DEVICES (8)")
    p.add_argument("--servers", type=int, default=16, help="servers, on host s mod hosts (16)")
    p.add_argument("--steps", type=int, default=3, help="rounds of push_pull (3)")
    p.add_argument("--rate", default="10gbit", help="each host's NIC (10gbit: this checks results, not speed)")
    p.add_argument("--join-timeout", type=float, default=900.0, help="BPS_GC_JOIN_TIMEOUT (900 s)")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds for the whole job (1500)")
    p.add_argument("--json", default=os.path.join(ROOT, "out", "recipe_shape.json"))
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    if args.hosts < 1 or args.local_ranks < 1 or args.servers < 1 or args.steps < 1:
        p.error("--hosts, --local-ranks, --servers and --steps must be >= 1")
    return args


def rank_input(rank, tensor, step, size):
    """Small integers (|x| <= 8): any summation order of up to 2^20 ranks is exact in float32."""
    return ((np.arange(size, dtype=np.int64) * 5 + rank * 31 + tensor * 7 + step * 13) % 17 - 8).astype(np.float32)


def averaged(tensor):
    return tensor % 2 == 0


def expected(tensor, step, size, ranks):
    total = np.zeros(size, np.float64)
    for r in range(ranks):
        total += rank_input(r, tensor, step, size)
    out = total.astype(np.float32)  # exact: integers far below 2^24
    return out / np.float32(ranks) if averaged(tensor) else out


def worker_main(argv):
    """One rank: push_pull every tensor --steps times, save what it pulled."""
    out_dir, steps = argv[0], int(argv[1])
    import bps_gc.core as bps
    bps.init()
    rank, size = bps.rank(), bps.size()
    for t, n in enumerate(TENSORS):
        bps.declare(f"recipe.{t}", shape=(n,), dtype=np.float32)
    got = {}
    for step in range(steps):
        handles = [(t, bps.push_pull(rank_input(rank, t, step, n), f"recipe.{t}", average=averaged(t)))
                   for t, n in enumerate(TENSORS)]
        for t, h in handles:
            got[f"{t}/{step}"] = np.asarray(h.wait()).copy()
    pushed = bps.metrics().pushed_wire  # since init: what this rank sent its servers (its share)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), size=np.int64(size), pushed=np.int64(pushed), **got)
    bps.shutdown()


def plan(net, args, out_dir):
    from bench_cluster import child_env
    launch = [PY, "-m", "bps_gc.launcher.cli"]
    common = {"DMLC_NUM_WORKER": str(args.hosts), "DMLC_NUM_SERVER": str(args.servers),
              "DMLC_PS_ROOT_URI": net.addr[0], "DMLC_PS_ROOT_PORT": str(PORT)}
    harness = harness_env(args)
    jobs = [("scheduler", net.command(0, launch), child_env({**common, **RECIPE_SCHEDULER, **harness}))]
    for s in range(args.servers):
        jobs.append((f"server{s}", net.command(s % args.hosts, launch),
                     child_env({**common, **RECIPE_SERVER, **harness})))
    worker = [PY, SCRIPT, "_worker", out_dir, str(args.steps)]
    for h in range(args.hosts):
        env = {**common, **RECIPE_WORKER, **harness, "DMLC_WORKER_ID": str(h),
               "NVIDIA_VISIBLE_DEVICES": ",".join(str(d) for d in range(args.local_ranks))}
        jobs.append((f"worker{h}", net.command(h, launch + worker), child_env(env)))
    return jobs


def harness_env(args):
    """What this machine needs beyond the recipe: time to start everything on few cores."""
    return {"BPS_GC_JOIN_TIMEOUT": str(args.join_timeout), "BPS_GC_HEARTBEAT_TIMEOUT": "120",
            "BPS_GC_STALL_TIMEOUT": "600"}


def check(out_dir, args):
    """[problem, ...] over every rank's results against numpy (empty: all exact)."""
    ranks = args.hosts * args.local_ranks
    problems = []
    wanted = {(t, s): expected(t, s, n, ranks) for t, n in enumerate(TENSORS) for s in range(args.steps)}
    for r in range(ranks):
        path = os.path.join(out_dir, f"rank{r}.npz")
        if not os.path.exists(path):
            problems.append(f"rank {r} wrote no results")
            continue
        got = np.load(path)
        if int(got["size"]) != ranks:
            problems.append(f"rank {r}: bps.size() = {int(got['size'])}, expected {ranks}")
        host_files = [os.path.join(out_dir, f"rank{q}.npz") for q in range(r - r % args.local_ranks, r + 1)]
        if r % args.local_ranks == args.local_ranks - 1 and "pushed" in got and all(map(os.path.exists, host_files)):
            host = sum(int(np.load(path)["pushed"]) for path in host_files)
            one_copy = 4 * sum(TENSORS) * args.steps
            if host != one_copy:  # two levels: each host pushes every tensor once
                problems.append(f"host {r // args.local_ranks} pushed {host} bytes, not one copy of "
                                f"every tensor per step ({one_copy})")
        for (t, s), value in wanted.items():
            mine = got[f"{t}/{s}"]
            if mine.dtype != value.dtype or mine.tobytes() != value.tobytes():
                problems.append(f"rank {r} tensor {t} ({TENSORS[t]} elements) step {s}: max difference "
                                f"{np.abs(mine.astype(np.float64) - value).max():g}")
    return problems


def main(argv=None):
    args = parse_args(argv)

    interrupt_on_signals()
    from bench_cluster import Children, ClusterFailed, log_tail, run_cluster
    netns = import_netns()
    log_dir = tempfile.mkdtemp(prefix="recipe_shape-")
    out_dir = os.path.join(log_dir, "results")
    os.makedirs(out_dir)
    children, net, failed = Children(), None, True
    what = f"{args.hosts} hosts x {args.local_ranks} local ranks, {args.servers} servers"
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": sys.argv,
              "machine": machine_info(), "hosts": args.hosts, "local_ranks": args.local_ranks,
              "servers": args.servers, "steps": args.steps, "tensors": TENSORS, "rate": args.rate,
              "recipe_env": {"scheduler": RECIPE_SCHEDULER, "server": RECIPE_SERVER, "worker": RECIPE_WORKER},
              "harness_env": harness_env(args), "loadavg_before": os.getloadavg()}
    try:
        try:
            net = netns.SwitchedMachines(args.rate, args.hosts).__enter__()
        except netns.NetnsUnavailable as e:
            print(f"recipe_shape: cannot set up network namespaces: {e}", file=sys.stderr)
            return 2
        start = time.monotonic()
        jobs = plan(net, args, out_dir)
        try:
            _, note = run_cluster(children, jobs, {name for name, _, _ in jobs if name.startswith("worker")},
                                  args.timeout, log_dir)
        except ClusterFailed as e:
            print(f"recipe_shape: {what}: FAILED: {e.args[0]}", file=sys.stderr)
            for c in (e.args[1] if len(e.args) > 1 else []):
                tail = log_tail(c, 8).strip()
                if tail:
                    print(f"--- {c.name}\n{tail}", file=sys.stderr)
            report["error"] = str(e.args[0])
            return 1
        report["seconds"] = time.monotonic() - start
        if note:
            report["note"] = note
        problems = check(out_dir, args)
        report["problems"] = problems
        report["ranks_checked"] = args.hosts * args.local_ranks
        failed = bool(problems)
        for line in problems[:20]:
            print(f"recipe_shape: MISMATCH {line}", file=sys.stderr)
        verdict = "MISMATCH" if problems else "exact, each host pushing one copy of every tensor,"
        print(f"recipe_shape: {what} ({args.hosts * args.local_ranks} ranks, {net.describe()}); "
              f"{len(TENSORS)} tensors x {args.steps} steps on every rank: {verdict} against numpy; "
              f"{report['seconds']:.1f} s from the first launch to the last exit; {machine_info()}")
        return 1 if failed else 0
    except KeyboardInterrupt:
        print("recipe_shape: interrupted", file=sys.stderr)
        return 130
    finally:
        tear_down(children, net)
        report["loadavg_after"] = os.getloadavg()
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_json_atomic(args.json, report)
        if failed or args.keep_logs:
            print(f"logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit(main())
