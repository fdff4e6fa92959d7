"""BytePS's recipe at its full shape (root only): 8 worker hosts x 8 local ranks and 16 servers,
each host a network namespace on a switch (scripts/netns.py), one bpslaunch per role with the
recipe's environment as written (NVIDIA_VISIBLE_DEVICES=0,...,7 and worker.sh's settings on the
workers only, no BYTEPS_LOCAL_SIZE anywhere), small tensors. Every rank's result is compared,
bit for bit, with the numpy model of two levels (tests/local_ranks.py); prints one line and
writes JSON.

    python scripts/recipe_shape.py [--hosts 8] [--local-size 8] [--servers 16] [--json out.json]
"""
import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--local-size", type=int, default=8)
    parser.add_argument("--servers", type=int, default=16)
    parser.add_argument("--rate", default="10gbit", help="each machine's NIC (tbf), both directions")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    from local_ranks import expected_results, run_spec
    from netns import NetnsUnavailable, SwitchedMachines
    from test_local_ranks import RECIPE_WORKER, SPEC
    started = time.monotonic()
    try:
        with SwitchedMachines(args.rate, args.hosts) as net:
            with tempfile.TemporaryDirectory() as tmp:
                results = run_spec(net, SPEC, pathlib.Path(tmp), args.hosts, args.local_size, args.servers,
                                   bound=900, worker_env=RECIPE_WORKER,
                                   # dozens of processes starting on a small box: lenient heartbeats
                                   env={"BPS_GC_HEARTBEAT_TIMEOUT": "60", "BPS_GC_HEARTBEAT_INTERVAL": "2"})
    except NetnsUnavailable as e:
        print(f"skipped: {e}")
        return 0
    expected = expected_results(SPEC, args.hosts, args.local_size)
    wrong = [f"rank {r} {k}" for r, got in enumerate(results) for k, v in expected.items()
             if got[k].tobytes() != v.tobytes()]
    row = {"hosts": args.hosts, "local_size": args.local_size, "servers": args.servers, "ranks": len(results),
           "tensors": len(SPEC["tensors"]), "steps": SPEC["steps"], "wrong": wrong,
           "seconds": round(time.monotonic() - started, 1)}
    print(f"{args.hosts} hosts x {args.local_size} local ranks, {args.servers} servers: {len(results)} ranks, "
          f"{'every result exact' if not wrong else f'{len(wrong)} results differ'} "
          f"({row['seconds']} s including start-up)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(row, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
