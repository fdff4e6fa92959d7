"""Two levels against the flat path (root only): M hosts x L local ranks, each host a network
namespace on a shaped switch (scripts/netns.py), one server per host, one bpslaunch per role.
Each row is one dense push_pull of N float32 elements, timed on rank 0 after a barrier (the
first round, which maps the buffers, is not counted); the median of the rounds is printed with
the line-rate floor: with one server per host each NIC sends and receives 2 (M-1)/M copies of
the tensor (the pushes of the parts other hosts serve, and the pulls of theirs).

    python scripts/bench_two_level.py [--hosts 2] [--local-size 4] [--rate 1gbit]
                                      [--elements 6400000] [--rounds 3] [--json out.json]
"""
import argparse
import json
import os
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]

JOB = textwrap.dedent("""
    import sys, time, numpy as np, bps_gc.core as bps
    n, rounds = int(sys.argv[1]), int(sys.argv[2])
    bps.init()
    bps.declare("g", shape=(n,), dtype=np.float32)
    x = np.ones(n, np.float32)
    times = []
    for _ in range(rounds + 1):
        x[:] = 1
        bps.barrier()
        start = time.perf_counter()
        bps.push_pull(x, "g", average=False).wait()
        times.append(time.perf_counter() - start)
    assert np.all(x == bps.size()), x[:3]
    if bps.rank() == 0:
        print("SECONDS", *("%.4f" % t for t in times[1:]), flush=True)
    bps.shutdown()
""")


def run(net, args, hierarchy):
    from local_ranks import HostsJob
    job = HostsJob(net, args.hosts, [args.local_size] * args.hosts, args.hosts,
                   [sys.executable, "-c", JOB, str(args.elements), str(args.rounds)],
                   # many processes on a small box: lenient heartbeats
                   env={"BPS_GC_HIERARCHY": hierarchy, "BPS_GC_HEARTBEAT_TIMEOUT": "30",
                        "BPS_GC_HEARTBEAT_INTERVAL": "1"})
    statuses, _ = job.wait_all(600)
    lines = [line for line in job.text("worker0").splitlines() if "SECONDS" in line]
    if set(statuses.values()) != {0} or not lines:
        raise SystemExit(f"the {hierarchy} job failed:\n{job.report(statuses)}")
    return [float(t) for t in lines[0].split("SECONDS", 1)[1].split()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--local-size", type=int, default=4)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--elements", type=int, default=6_400_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    from netns import NetnsUnavailable, SwitchedMachines, parse_rate
    nbytes = 4 * args.elements
    floor = 2 * (args.hosts - 1) / args.hosts * nbytes * 8 / parse_rate(args.rate)
    rows = []
    try:
        with SwitchedMachines(args.rate, args.hosts) as net:
            for hierarchy in ("flat", "host"):
                times = run(net, args, hierarchy)
                median = sorted(times)[len(times) // 2]
                rows.append({"hierarchy": hierarchy, "seconds": times, "median": median,
                             "floor": round(floor, 4), "x_floor": round(median / floor, 2)})
    except NetnsUnavailable as e:
        print(f"skipped: {e}")
        return 0
    print(f"{args.hosts} hosts x {args.local_size} local ranks, {args.hosts} servers (one per host), "
          f"{args.rate}, dense {nbytes / 1e6:.1f} MB, median of {args.rounds}")
    print(f"{'BPS_GC_HIERARCHY':<18}{'seconds':>9}{'floor':>8}{'x floor':>9}")
    for row in rows:
        print(f"{row['hierarchy']:<18}{row['median']:>9.3f}{row['floor']:>8.3f}{row['x_floor']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
