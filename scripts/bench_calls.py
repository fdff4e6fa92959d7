#!/usr/bin/env python3
"""What a parameter-server round costs, old commit against the working tree, in measures a
shared machine moves little: Python calls per function and CPU seconds, not wall time.

Each version (the old commit in a temporary `git worktree` with this tree's bench scripts, as
bench_versions.py runs it) runs scripts/bench_pushpull.py on one --config (2 workers, servers
colocated, ResNet-50's 161 gradients) twice, with --rounds A and B timed rounds after the same
warm-up, and each figure per round is (run B - run A) / (B - A): set-up and warm-up cancel.

  calls (default)  bench_pushpull --profile, every thread of worker 0 and of both servers under
                   cProfile (BENCH_PROFILE_DIR keeps the raw stats): per round, each function's
                   calls (deterministic, but for the I/O loops' polls) and own thread-CPU
                   seconds, the functions whose counts or seconds differ most; and each thread's
                   CPU seconds and context switches (getrusage)
  --cpu            no profiler: the CPU seconds per round of every process of the job together
                   (the bench's whole process tree, user + system) and of each worker, --passes
                   times, old and new interleaved (old, new, new, old, ...)
  --together       both versions' jobs at once, B rounds each, --passes times: wall s/round of
                   each under the same load (the two jobs load each other too: a 2-core box
                   runs each at about half speed, so this is no quiet-box figure)

    python scripts/bench_calls.py --config onebit+EF                 # ~1 min on the 2-core box
    python scripts/bench_calls.py --config "randomk 0.1%" --cpu --rounds 5,125 --passes 3
    python scripts/bench_calls.py --config "randomk 0.1%" --together --rounds 5,200 --passes 4
"""
import argparse
import glob
import json
import os
import pstats
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

from bench_common import PY, ROOT
from bench_versions import make_old_tree

HARNESS = ("bench_pushpull.py", "bench_workers.py", "bench_common.py", "bench_report.py", "bench_cluster.py",
           "bench_run.py", "bench_collective.py", "bench_host_floor.py")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default="2ed851b", help="the commit to compare against (2ed851b, issue 43's branch point)")
    p.add_argument("--config", default="onebit+EF", help="a bench_pushpull PS configuration (onebit+EF)")
    p.add_argument("--rounds", default="3,33", help="the two runs' timed rounds, A,B (3,33; --cpu: 5,65)")
    p.add_argument("--cpu", action="store_true", help="CPU seconds per round without the profiler")
    p.add_argument("--together", action="store_true", help="wall s/round of both versions' jobs run at once "
                   "(B rounds each)")
    p.add_argument("--passes", type=int, default=1, help="--cpu: old/new passes (1)")
    p.add_argument("--top", type=int, default=25, help="functions listed per role (25)")
    args = p.parse_args(argv)
    try:
        args.a, args.b = (int(x) for x in args.rounds.split(","))
    except ValueError:
        p.error("--rounds takes two numbers A,B")
    if not 0 < args.a < args.b or args.passes < 1:
        p.error("--rounds needs 0 < A < B; --passes >= 1")
    return args


def start_job(tree, config, rounds, profile_dir=None):
    """One bench_pushpull run from ``tree``, started: (its process, where its JSON goes)."""
    env = dict(os.environ, PYTHONPATH=tree)
    if profile_dir:
        env["BENCH_PROFILE_DIR"] = profile_dir
    out = tempfile.mktemp(suffix=".json")
    argv = [PY, os.path.join(tree, "scripts", "bench_pushpull.py"), "--configs", config, "--collective-rows", "none",
            "--pslite", "none", "--tensors", "0", "--warmup", "2", "--rounds", str(rounds), "--json", out]
    proc = subprocess.Popen(argv + (["--profile"] if profile_dir else []), cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def job_row(tree, proc, out):
    """The PS row of a started run, once it ended."""
    text = proc.communicate()[0]
    if proc.returncode != 0 or not os.path.exists(out):
        sys.exit(f"bench_calls: {tree}: bench_pushpull failed:\n{text[-2000:]}")
    with open(out) as f:
        row = next(r for r in json.load(f)["results"] if r["system"] == "bps_gc PS")
    os.unlink(out)
    return row


def run_job(tree, config, rounds, profile_dir=None):
    """One bench_pushpull run from ``tree``: (its PS row, CPU seconds of its process tree)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = job_row(tree, *start_job(tree, config, rounds, profile_dir))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return row, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def compare_together(args, trees):
    """Both versions' jobs at once, --passes times: whatever else loads the box loads both alike."""
    ratios = []
    for p in range(args.passes):
        order = ("old", "new") if p % 2 == 0 else ("new", "old")  # the first started sets up first
        started = {v: start_job(trees[v], args.config, args.b) for v in order}
        rows = {v: job_row(trees[v], *started[v]) for v in order}
        ratios.append(rows["new"]["seconds"] / rows["old"]["seconds"])
        print(f"pass {p + 1}: wall s/round old {rows['old']['seconds']:.4f}, new {rows['new']['seconds']:.4f}, "
              f"new/old {ratios[-1]:.3f}; worker CPU s/round old "
              f"{statistics.mean(rows['old']['worker_cpu_per_round']):.4f}, new "
              f"{statistics.mean(rows['new']['worker_cpu_per_round']):.4f} (load average {os.getloadavg()[0]:.1f})",
              flush=True)
    print(f"new/old wall, both at once: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


# modules renamed since 2ed851b, under their new names, so that a rename is no difference
RENAMED = {"bps_gc/transport/": "bps_gc/wire/", "bps_gc/ps/worker/state.py": "bps_gc/ps/worker/codec_state.py",
           "bps_gc/ps/server/state.py": "bps_gc/ps/server/key_state.py",
           "bps_gc/compress/state.py": "bps_gc/compress/stateful.py"}


def function_stats(folder, role):
    """(file under bps_gc/ or the stdlib, function) -> [calls, own s] over ``role``'s threads."""
    totals = defaultdict(lambda: [0, 0.0])
    for path in glob.glob(os.path.join(folder, f"{role}-*.prof")):
        for (file, _, name), (_, calls, own, _, _) in pstats.Stats(path).stats.items():
            where = re.sub(r".*/(bps_gc/|lib/python3\.\d+/)", r"\1", file)
            for before, after in RENAMED.items():
                where = where.replace(before, after)
            name = re.sub(r" at 0x[0-9a-f]+", "", name)  # a built-in's address differs by process
            totals[(where, name)][0] += calls
            totals[(where, name)][1] += own
    return totals


def thread_usage(folder, role):
    """thread name (or "process") -> {getrusage field: value} summed over ``role``'s processes."""
    totals = defaultdict(lambda: defaultdict(float))
    for path in glob.glob(os.path.join(folder, f"{role}-*.rusage.json")):
        with open(path) as f:
            for thread, usage in json.load(f).items():
                for field, value in usage.items():
                    totals[thread][field] += value
    return totals


def per_round(short, long_, n):
    return {k: [(v[i] - short.get(k, (0, 0))[i]) / n for i in range(2)] for k, v in long_.items()}


def compare_calls(args, trees, work):
    n = args.b - args.a
    stats, usage = {}, {}
    for version, tree in trees.items():
        dirs = {}
        for rounds in (args.a, args.b):
            dirs[rounds] = os.path.join(work, f"{version}-{rounds}")
            os.makedirs(dirs[rounds])
            run_job(tree, args.config, rounds, dirs[rounds])
        for role in ("worker0", "server"):
            stats[version, role] = per_round(function_stats(dirs[args.a], role), function_stats(dirs[args.b], role), n)
            short, long_ = thread_usage(dirs[args.a], role), thread_usage(dirs[args.b], role)
            usage[version, role] = {t: {f: (v - short[t][f]) / n for f, v in fields.items()}
                                    for t, fields in long_.items() if t in short}
    for role in ("worker0", "server"):
        old, new = stats["old", role], stats["new", role]
        calls = {v: sum(c for c, _ in stats[v, role].values()) for v in ("old", "new")}
        print(f"\n{role} ({'both servers' if role == 'server' else 'rank 0'}), per round: {calls['old']:.0f} Python "
              f"calls old, {calls['new']:.0f} new")
        for version in ("old", "new"):
            for thread, u in sorted(usage[version, role].items()):
                if u.get("ru_utime", 0) + u.get("ru_stime", 0) > 1e-4:
                    print(f"  {version:3} {thread:18} CPU {1e3 * (u['ru_utime'] + u['ru_stime']):6.2f} ms  "
                          f"context switches {u['ru_nvcsw']:6.1f} voluntary {u['ru_nivcsw']:6.1f} forced")
        keys = set(old) | set(new)
        moved = sorted(keys, key=lambda k: -abs(new.get(k, (0, 0))[0] - old.get(k, (0, 0))[0]))
        print(f"  {'calls old':>9} {'new':>7} {'own ms old':>10} {'new':>6}  function (most changed call counts)")
        for k in moved[:args.top]:
            (oc, ot), (nc, nt) = old.get(k, (0, 0)), new.get(k, (0, 0))
            if abs(nc - oc) >= 1:
                print(f"  {oc:9.1f} {nc:7.1f} {1e3 * ot:10.2f} {1e3 * nt:6.2f}  {k[0]}:{k[1]}")


def compare_cpu(args, trees):
    n = args.b - args.a
    found = defaultdict(list)
    for p in range(args.passes):
        for version in ("old", "new") if p % 2 == 0 else ("new", "old"):
            short, long_ = (run_job(trees[version], args.config, r) for r in (args.a, args.b))
            workers = statistics.mean(long_[0]["worker_cpu_per_round"])
            found[version].append(((long_[1] - short[1]) / n, workers, long_[0]["seconds"]))
            print(f"pass {p + 1} {version}: job {found[version][-1][0]:.4f} CPU s/round, worker {workers:.4f}, "
                  f"wall {long_[0]['seconds']:.4f} s/round (load average {os.getloadavg()[0]:.1f})", flush=True)
    for version, runs in found.items():
        print(f"{version}: job CPU s/round mean {statistics.mean(r[0] for r in runs):.4f} "
              f"({', '.join(f'{r[0]:.4f}' for r in runs)}); worker {statistics.mean(r[1] for r in runs):.4f}")


def main(argv=None):
    args = parse_args(argv)
    if (args.cpu or args.together) and args.rounds == "3,33":
        args.a, args.b = 5, 65
    work = tempfile.mkdtemp(prefix="bench_calls-")
    old_tree = os.path.join(work, "old")
    try:
        print(f"bench_calls: old {make_old_tree(args.old, old_tree)[:7]} against {ROOT}; {args.config}, "
              f"rounds {args.a} and {args.b}; load average {os.getloadavg()[0]:.1f}", flush=True)
        for script in HARNESS:  # this tree's harness (the profiler's dumps) on the old package
            shutil.copy(os.path.join(ROOT, "scripts", script), os.path.join(old_tree, "scripts", script))
        trees = {"old": old_tree, "new": ROOT}
        if args.together:
            compare_together(args, trees)
        elif args.cpu:
            compare_cpu(args, trees)
        else:
            compare_calls(args, trees, work)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", old_tree], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
