#!/usr/bin/env python3
"""An older commit against the working tree, interleaved in one run: the same benchmarks,
old, new, new, old, old, new..., so that a load that comes and goes on the machine (or drifts
through the run) hits both alike.

The old commit (default 2ed851b, issue 43's branch point) is checked out into a temporary
`git worktree` (removed at the end); each version's scripts run from their own tree with their
own package on PYTHONPATH (ahead of this checkout's editable install) and this interpreter
(its .venv). Each pass runs, for each version in turn:
  pushpull      scripts/bench_pushpull.py: its default rows (--configs, --pslite and
                --collective-rows pick others; ps-lite's rows are off by default: they run no
                bps_gc code), 2 ranks on loopback, on the first --tensors of ResNet-50's 161
                gradients (0: all of them)
  hook quick    scripts/bench_hook.py, every row, on the MLP of its --quick (3 x 256, batch 16);
                each row also as "[cpu s]": rank 0's CPU seconds per step, every thread
  hook full     (--hooks full) the same on its default MLP (6 x 1024, batch 112)
  hook resnet50 (--hooks resnet50) the same on ResNet-50's 161 gradient shapes (its --model
                resnet50-shapes)
Both versions run this tree's scripts/bench_hook.py (with bench_models.py and bench_cluster.py),
scripts/bench_collective.py and scripts/bench_run.py (copied into the old tree): the same harness
and rows (the floor, dense in place, their CPU seconds), only the package differs.
Each version's value of a row is the median over the passes of that pass's median s/round (or
s/step); new/old is their ratio, and "pairs" the range of the ratios of each pass's old and new
run, one right after the other. The numbers come from each benchmark's own JSON.

    python scripts/bench_versions.py                          # ~5 min on the 2-core box
    python scripts/bench_versions.py --old main --passes 3 --hooks quick,full
    python scripts/bench_versions.py --collective-rows "all_reduce,floor,collective dense" \\
        --configs none --tensors 0 --rounds 10 --hooks none --passes 5   # the dense path against gloo's

JSON (--json, default out/bench_versions.json): the box, both commits, every run's rows and
the table's rows.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import PY, ROOT, machine_info, pythonpath, write_json_atomic

HOOK_SHAPES = {"quick": ["--width", "256", "--layers", "3", "--batch", "16"],
               "full": ["--width", "1024", "--layers", "6", "--batch", "112"],
               "resnet50": ["--model", "resnet50-shapes"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default="2ed851b", help="the commit to compare against (2ed851b)")
    p.add_argument("--passes", type=int, default=3, help="old/new passes (3)")
    p.add_argument("--tensors", type=int, default=30, help="pushpull: the first N of ResNet-50's "
                   "gradients (30: 9.4 MB; 0: all 161, 102 MB)")
    p.add_argument("--rounds", type=int, default=5, help="pushpull: timed rounds per pass (5)")
    p.add_argument("--warmup", type=int, default=1, help="pushpull: warm-up rounds (1)")
    p.add_argument("--configs", default=None, help="pushpull: its --configs (default: all; 'none')")
    p.add_argument("--pslite", default="none", help="pushpull: its --pslite ('none')")
    p.add_argument("--collective-rows", default=None, help="pushpull: its --collective-rows, e.g. "
                   "'all_reduce,collective dense' (default: all)")
    p.add_argument("--no-pushpull", action="store_true", help="bench_hook only")
    p.add_argument("--hooks", default="quick", help="bench_hook shapes, comma-separated: quick, full, resnet50; "
                   "'none' (quick)")
    p.add_argument("--hook-rounds", type=int, default=30, help="bench_hook: steps per pass (30)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per benchmark run (900)")
    p.add_argument("--json", default=os.path.join(ROOT, "out", "bench_versions.json"))
    args = p.parse_args(argv)
    args.hooks = [] if args.hooks.strip() == "none" else [h.strip() for h in args.hooks.split(",") if h.strip()]
    unknown = [h for h in args.hooks if h not in HOOK_SHAPES]
    if args.no_pushpull and not args.hooks:
        p.error("--no-pushpull with --hooks none leaves nothing to run")
    if unknown or args.passes < 1 or args.rounds < 1 or args.tensors < 0:
        p.error(f"--hooks takes {', '.join(HOOK_SHAPES)} or none; --passes, --rounds >= 1, --tensors >= 0")
    return args


def benches(args):
    """[(name, argv after the interpreter given the tree and a JSON path, rows from that JSON)]."""
    pushpull = ["--tensors", str(args.tensors), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                "--pslite", args.pslite]
    for flag, value in (("--configs", args.configs), ("--collective-rows", args.collective_rows)):
        if value is not None:
            pushpull += [flag, value]
    out = [] if args.no_pushpull else [("pushpull", lambda tree, path: [
        os.path.join(tree, "scripts", "bench_pushpull.py"), *pushpull, "--json", path], pushpull_rows)]
    for shape in args.hooks:
        hook = [*HOOK_SHAPES[shape], "--warmup", "3", "--rounds", str(args.hook_rounds)]
        out.append((f"hook {shape}", lambda tree, path, hook=hook: [
            os.path.join(tree, "scripts", "bench_hook.py"), *hook, "--json", path], hook_rows))
    return out


def pushpull_rows(report):
    """Each row's median s/round; the collective block's also as "[cpu s]": rank 0's median CPU
    seconds per round, every thread (bench_collective.py)."""
    rows = {}
    for r in report["results"]:
        if r.get("seconds") is None:
            continue
        label = f"{r['system']} | {r['config']}" + (f" | {r['topology']}" if r["system"] in ("bps_gc PS", "ps-lite") else "")
        rows[label] = r["seconds"]
        if r.get("cpu_s") is not None:
            rows[f"{label} [cpu s]"] = r["cpu_s"]
    return rows


def hook_rows(report):
    """Each row's median s/step, and its median CPU s/step of rank 0 (every thread): on a shared
    machine the CPU a step takes moves less than its wall time."""
    rows = {}
    for r in report["rows"]:
        rows[r["row"]] = r["median_s"]
        if r.get("cpu_s") is not None:
            rows[f"{r['row']} [cpu s]"] = r["cpu_s"]
    return rows


def make_old_tree(commit, where):
    """A detached worktree of ``commit`` at ``where``; returns its full hash."""
    full = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    subprocess.run(["git", "worktree", "add", "--detach", where, full], cwd=ROOT, check=True, capture_output=True)
    for script in ("bench_hook.py", "bench_hook_timeline.py", "bench_models.py", "bench_collective.py", "bench_run.py",
                   "bench_cluster.py"):
        shutil.copy(os.path.join(ROOT, "scripts", script), os.path.join(where, "scripts", script))
    return full


def run_bench(tree, argv, timeout, log):
    """One benchmark run from ``tree`` (its package first on the path); its JSON, or None."""
    env = dict(os.environ, PYTHONPATH=pythonpath(tree))
    path = argv[argv.index("--json") + 1]
    with open(log, "w") as f:
        try:
            proc = subprocess.run([PY, *argv], cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    if proc.returncode != 0 or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def commit_of(tree):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree,
                           capture_output=True, text=True).stdout.strip()
    return head + (" + changes" if dirty else "")


def table(runs, names):
    """Rows: (bench, row, old median, new median, new/old, lowest and highest pair ratio, passes)."""
    rows = []
    for bench in names:
        labels = []
        for run in runs:
            if run["bench"] == bench:
                labels += [label for label in run["rows"] if label not in labels]
        for label in labels:
            per = {"old": [], "new": []}
            pairs = {}
            for run in runs:
                if run["bench"] == bench and label in run["rows"]:
                    per[run["version"]].append(run["rows"][label])
                    pairs.setdefault(run["pass"], {})[run["version"]] = run["rows"][label]
            old = statistics.median(per["old"]) if per["old"] else None
            new = statistics.median(per["new"]) if per["new"] else None
            ratios = [p["new"] / p["old"] for p in pairs.values() if len(p) == 2 and p["old"] > 0]
            rows.append({"bench": bench, "row": label, "old_s": old, "new_s": new,
                         "new_over_old": new / old if old and new is not None else None,
                         "pair_ratios": ratios, "passes": [len(per["old"]), len(per["new"])]})
    return rows


def dense_ratios(runs, config="dense", unit=""):
    """version -> the median over its pushpull runs of collective ``config`` (dense, or dense in
    place) / gloo's all_reduce (of the same run), where both rows ran; ``unit`` " [cpu s]": of
    their CPU seconds."""
    ratios = {}
    for run in runs:
        dense = run["rows"].get(f"bps_gc collective | {config}{unit}")
        gloo = run["rows"].get(f"torch | torch all_reduce dense{unit}")
        if dense and gloo:
            ratios.setdefault(run["version"], []).append(dense / gloo)
    return {version: statistics.median(r) for version, r in ratios.items()}


def print_table(rows, title):
    print(title)
    width = max([len(r["row"]) for r in rows] + [10])
    print(f"{'bench':<13} {'row':<{width}} {'old s':>9} {'new s':>9} {'new/old':>8} {'pairs':>12} {'passes':>7}")
    for r in rows:
        def s(v):
            return f"{v:9.4f}" if v is not None else f"{'-':>9}"
        ratio = f"{r['new_over_old']:8.3f}" if r["new_over_old"] is not None else f"{'-':>8}"
        pairs = f"{min(r['pair_ratios']):.2f}-{max(r['pair_ratios']):.2f}" if r["pair_ratios"] else "-"
        print(f"{r['bench']:<13} {r['row']:<{width}} {s(r['old_s'])} {s(r['new_s'])} {ratio} {pairs:>12} "
              f"{r['passes'][0]:>3}/{r['passes'][1]:<3}")


def main(argv=None):
    args = parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_versions-")
    old_tree = os.path.join(work, "old")
    started = time.monotonic()
    load_before = os.getloadavg()
    try:
        old_commit = make_old_tree(args.old, old_tree)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(work, ignore_errors=True)
        sys.exit(f"bench_versions: cannot check out {args.old!r}: {(e.stderr or b'').decode().strip() or e}")
    trees = {"old": old_tree, "new": ROOT}
    for version, tree in trees.items():  # its own package, its native kernels built before any timing
        found = subprocess.run([PY, "-c", "import bps_gc, bps_gc.compress, bps_gc.torch; print(bps_gc.__file__)"],
                               cwd=tree, env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True)
        if not found.stdout.strip().startswith(os.path.join(tree, "bps_gc")):
            subprocess.run(["git", "worktree", "remove", "--force", old_tree], cwd=ROOT, capture_output=True)
            shutil.rmtree(work, ignore_errors=True)
            sys.exit(f"bench_versions: the {version} tree imports bps_gc from {found.stdout.strip() or '?'}, "
                     f"not {tree}: {found.stderr[-500:]}")
    commits = {"old": old_commit[:7], "new": commit_of(ROOT)}
    box = f"{platform.node()}: {machine_info()}"
    print(f"bench_versions: old {commits['old']} against new {commits['new']} ({ROOT}); {box}", flush=True)
    runs, kinds = [], benches(args)
    try:
        for n in range(args.passes):
            for bench, make_argv, read_rows in kinds:
                for version in ("old", "new") if n % 2 == 0 else ("new", "old"):  # drift hits both alike
                    path = os.path.join(work, f"{bench.replace(' ', '_')}.{version}.{n}.json")
                    log = path.replace(".json", ".log")
                    began = time.monotonic()
                    report = run_bench(trees[version], make_argv(trees[version], path), args.timeout, log)
                    seconds = time.monotonic() - began
                    if report is None:
                        with open(log) as f:
                            tail = f.read()[-2000:]
                        print(f"pass {n + 1}/{args.passes} {bench} {version}: FAILED after {seconds:.0f} s; "
                              f"its output's end:\n{tail}", flush=True)
                        continue
                    rows = read_rows(report)
                    runs.append({"pass": n, "bench": bench, "version": version, "seconds": seconds,
                                 "loadavg": os.getloadavg()[0], "rows": rows})
                    print(f"pass {n + 1}/{args.passes} {bench} {version}: {len(rows)} rows in {seconds:.0f} s "
                          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    except KeyboardInterrupt:
        print("bench_versions: interrupted; the table has the runs so far", file=sys.stderr)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", old_tree], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    rows = table(runs, [b for b, _, _ in kinds])
    load_after = os.getloadavg()
    title = (f"\nold {commits['old']} vs new {commits['new']}, {args.passes} interleaved passes; {box}; "
             f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; {time.monotonic() - started:.0f} s\n"
             f"old s / new s: median over the passes of each run's median s/round (pushpull) or s/step (hook); "
             f"pairs: new/old of each pass's two runs")
    if rows:
        print_table(rows, title)
    dense = dense_ratios(runs)
    for version, ratio in dense.items():
        print(f"issue 43's target, {version}: bps_gc collective dense / torch all_reduce dense = {ratio:.2f} "
              f"(median of each run's ratio; <= 1.1 asked)")
    for version, ratio in dense_ratios(runs, "dense in place").items():
        print(f"  in place (no out=), {version}: bps_gc collective dense in place / torch all_reduce dense = {ratio:.2f}")
    for version, ratio in dense_ratios(runs, "dense views").items():  # a version without the row: none
        print(f"  views of flat buffers, {version}: bps_gc collective dense views / torch all_reduce dense = {ratio:.2f}")
    for config in ("dense", "dense in place", "dense views"):
        for version, ratio in dense_ratios(runs, config, " [cpu s]").items():
            print(f"  CPU seconds, {version}: bps_gc collective {config} / torch all_reduce dense = {ratio:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json_atomic(args.json, {
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": sys.argv,
                 "host": platform.node(), "machine": machine_info(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "commits": commits, "passes": args.passes,
                 "loadavg_before": load_before, "loadavg_after": load_after},
        "rows": rows, "runs": runs, "collective_dense_over_all_reduce": dense_ratios(runs),
        "collective_dense_in_place_over_all_reduce": dense_ratios(runs, "dense in place")})
    print(f"wrote {args.json}")
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
