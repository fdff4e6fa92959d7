#!/usr/bin/env python3
"""End-to-end push_pull benchmark: bps_gc against MXNet's ps-lite parameter server.

ResNet-50 v1b gradients (tests/data/resnet50_shapes.json: 161 float32 tensors, 25.56M floats,
102.2 MB), random normal * 1e-3, generated once per worker and pushed every round. 2 workers and
1 server. A round is push_pull of all 161 tensors (priority -i) followed by waiting for all of
them; the time reported is worker 0's median over the timed rounds (after warm-up rounds).

bps_gc configurations: dense, onebit+EF (scaling), topk 0.1%, topk 1%, randomk 0.1%,
dithering k=2. ps-lite: mx.kv.create('dist_sync'), dense and 2bit (threshold 0.5), with its
scheduler and server started as MXNet does (`python -c "import mxnet"` with DMLC_ROLE set).

    python scripts/bench_pushpull.py --quick              # smoke run: dense + onebit, < 1 min
    python scripts/bench_pushpull.py                      # loopback, 2 warm-up + 10 timed rounds
    python scripts/bench_pushpull.py --shaped 1gbit       # root: two netns, veth shaped by tbf
    python scripts/bench_pushpull.py --shaped 100mbit --shaped-rounds 2

Loopback runs bps_gc with `bpslaunch --local`; --shaped puts the scheduler and server in one
network namespace and both workers in another, joined by a veth pair whose ends are each shaped
with `tc ... tbf rate RATE` (scripts/netns.py), and starts each role separately (DMLC_ROLE=...).
There the bytes that crossed the veth are counted too (/proc/net/dev in the workers'
namespace). Columns:
  s/round    worker 0's median seconds per round (min and max beside it)
  push/pull MB  bytes on the wire per round per worker as bps_gc counts them (bps.metrics())
  link MB/w  --shaped: bytes that crossed the veth per round per worker (both directions,
             including TCP/IP and framing overhead)
  GB/s/w     uncompressed bytes pushed per round per worker / round time
  CPU%       how busy the whole machine's CPUs were during worker 0's timed rounds (/proc/stat;
             100 = all CPUs busy: the run is CPU-bound, or something else was running)
  w CPU s    CPU seconds per round used by each worker process (all its threads)
  vs ps-lite round time / ps-lite dense round time measured in the same run
JSON goes to out/bench_pushpull.json (loopback) or out/bench_pushpull_<rate>.json (--shaped)
unless --json says otherwise. Every child process has a timeout and is killed (by PID, with its
process group) when the benchmark ends; the namespaces are always deleted.

BYTEPS_* / BPS_GC_* variables in the environment (e.g. BYTEPS_PARTITION_BYTES) are passed to
bps_gc and recorded in the JSON; DMLC_*, PS_* and MXNET_KVSTORE_BIGARRAY_BOUND are not (ps-lite
runs with its default big-array bound). --profile also cProfiles every thread of bps_gc's worker
0 and server (bps_gc configurations then run with separately started roles) and prints the top
functions.
"""
import argparse
import datetime
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time

import numpy as np

from bench_cluster import Children, ClusterFailed, Loopback, Shaped, bps_plan, log_tail, mx_plan, run_cluster
from bench_common import BPS_CONFIGS, MODEL, PSLITE_CONFIGS, QUICK_BPS, QUICK_PSLITE, ROOT, cpu_counters, import_netns, load_shapes, write_json_atomic
from bench_report import load_results, print_table, summarize
from bench_workers import bps_worker, mx_worker, profiled_node


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds on loopback (10)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds on loopback (2)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 warm-up + 2 rounds, bps_gc dense and onebit+EF, ps-lite dense")
    p.add_argument("--shaped", metavar="RATE",
                   help="run in two network namespaces joined by a veth shaped to RATE "
                        "(1gbit, 100mbit, ...) instead of loopback; needs root")
    p.add_argument("--shaped-rounds", type=int, default=3, help="timed rounds with --shaped (3)")
    p.add_argument("--shaped-warmup", type=int, default=1, help="warm-up rounds with --shaped (1)")
    p.add_argument("--passes", type=int, default=1,
                   help="run the whole list of configurations this many times, interleaved, "
                        "and pool the rounds (for machines shared with other jobs) (1)")
    p.add_argument("--configs", help=f"comma-separated bps_gc configurations (default all: "
                                     f"{', '.join(BPS_CONFIGS)}; 'none' for none)".replace("%", "%%"))
    p.add_argument("--pslite", default=None,
                   help="comma-separated ps-lite configurations (dense,2bit; 'none' for none)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per configuration before it is killed (loopback 300; "
                        "--shaped: scaled with the rate)")
    p.add_argument("--json", help="where to write the results (out/bench_pushpull.json, "
                                  "or out/bench_pushpull_<rate>.json with --shaped)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile bps_gc's worker 0 and server (all threads) and print the top")
    p.add_argument("--wait-idle", type=float, default=None, metavar="S",
                   help="before each configuration wait up to S seconds until the CPUs are "
                        "<= 25%% busy (other jobs on the machine); default 60, --quick 0")
    p.add_argument("--keep-logs", action="store_true", help="keep the children's logs")
    args = p.parse_args(argv)
    if args.wait_idle is None:
        args.wait_idle = 0.0 if args.quick else 60.0
    if args.quick:
        args.rounds, args.warmup = 2, 1
        args.shaped_rounds, args.shaped_warmup = 2, 1
    for name in ("rounds", "shaped_rounds", "passes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup", "shaped_warmup"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    args.bps = pick(p, args.configs, BPS_CONFIGS, QUICK_BPS if args.quick else None, "--configs")
    args.mx = pick(p, args.pslite, PSLITE_CONFIGS, QUICK_PSLITE if args.quick else None, "--pslite")
    if args.shaped:
        parse_rate = import_netns().parse_rate
        try:
            args.rate_bits = parse_rate(args.shaped)
        except ValueError as e:
            p.error(f"--shaped: {e}")
        args.shaped = args.shaped.lower()
    return args


def pick(parser, text, known, quick_default, flag):
    if text is None:
        return list(quick_default or known)
    if text.strip().lower() == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in known:
            parser.error(f"{flag}: unknown configuration {n!r}; known: {', '.join(known)}")
    return names


def machine_busy(seconds=1.0):
    """Fraction of all CPUs busy over the next ``seconds`` (None if /proc/stat is unreadable)."""
    before = cpu_counters()[0]
    time.sleep(seconds)
    after = cpu_counters()[0]
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def wait_until_idle(max_wait, threshold=0.25):
    """Wait (at most max_wait s) until other processes leave the CPUs mostly idle: timings on a
    shared 2-CPU machine mean little otherwise. Returns (seconds waited, last busy fraction)."""
    start = time.monotonic()
    busy = machine_busy()
    while busy is not None and busy > threshold and time.monotonic() - start < max_wait:
        busy = machine_busy()
    return time.monotonic() - start, busy


def config_timeout(args, shaped):
    if args.timeout:
        return args.timeout
    if not shaped:
        return 300.0
    # dense: each direction carries 2 x 102 MB through the link; allow 2x that per round
    per_round = 2 * 2 * 102.2e6 * 8 / args.rate_bits
    return 180 + (args.shaped_warmup + args.shaped_rounds + 2) * per_round * 2


def run_one(system, config, topo, args, children, result_dir, rounds, warmup, timeout, say):
    """One cluster for one configuration: (the workers' results, extra info) or raises."""
    os.makedirs(result_dir)
    if system == "bps_gc":
        plan, workers = bps_plan(config, topo, args, result_dir, result_dir, rounds, warmup)
    else:
        plan, workers = mx_plan(config, topo, result_dir, rounds, warmup)
    info = {"busy_before": None, "waited_idle_seconds": 0.0}
    if args.wait_idle > 0:
        waited, busy = wait_until_idle(args.wait_idle)
        info.update(busy_before=busy, waited_idle_seconds=waited)
        if busy is not None and busy > 0.25:
            say(f"{system} {config}: machine still {100 * busy:.0f}% busy after waiting "
                f"{waited:.0f} s for other processes; measuring anyway")
    t0 = time.monotonic()
    try:
        _, note = run_cluster(children, plan, workers, timeout, result_dir)
        results = load_results(result_dir, "bps" if system == "bps_gc" else "mx")
    except ClusterFailed as e:
        started = e.args[1] if len(e.args) > 1 else []
        say(f"{system} {config}: FAILED: {e.args[0]} (logs in {result_dir})")
        for c in started:
            tail = log_tail(c)
            if tail.strip():
                say(f"--- {c.name} (last lines)\n{tail.rstrip()}")
        raise
    info["wall_seconds"] = time.monotonic() - t0
    if note:
        info["note"] = note
        say(f"{system} {config}: note: {note}")
    profile = os.path.join(result_dir, "server-profile.txt")
    if os.path.exists(profile):
        with open(profile) as f:
            info["server_profile"] = f.read()
    w0 = results[0]
    med = statistics.median(r["seconds"] for r in w0["rounds"])
    extra = f", check {w0['check']}" if w0.get("check") else ""
    say(f"{system} {config}: {med:.3f} s/round (median of {len(w0['rounds'])}; worker 1 "
        f"{statistics.median(r['seconds'] for r in results[1]['rounds']):.3f}){extra}")
    return results, info


def run_all(args, topo, children, log_root):
    shaped = not isinstance(topo, Loopback)
    rounds = args.shaped_rounds if shaped else args.rounds
    warmup = args.shaped_warmup if shaped else args.warmup
    timeout = config_timeout(args, shaped)
    configs = [("ps-lite", c) for c in args.mx] + [("bps_gc", c) for c in args.bps]
    # with --passes N the whole list runs N times, interleaved, so that load from other jobs
    # on the machine hits every configuration alike
    work = [(p, system, config) for p in range(args.passes) for system, config in configs]
    runs = {key: [] for key in configs}
    infos = {key: [] for key in configs}
    errors = {}
    from tqdm import tqdm
    bar = tqdm(work, desc=f"push_pull {topo.name}", unit="config", file=sys.stderr)
    for p, system, config in bar:
        bar.set_postfix_str(f"{system} {config}" + (f" (pass {p + 1})" if args.passes > 1 else ""))
        if (system, config) in errors:
            continue
        tag = f"{system}-{config}-{p}".replace(" ", "_").replace("%", "pct").replace("+", "_")
        try:
            results, info = run_one(system, config, topo, args, children,
                                    os.path.join(log_root, tag), rounds, warmup, timeout, tqdm.write)
        except ClusterFailed as e:
            errors[(system, config)] = str(e.args[0])
            args.failed = True
            continue
        runs[(system, config)].append(results)
        infos[(system, config)].append(info)
    bar.close()
    rows = []
    for key in configs:
        if key in errors:
            rows.append({"system": key[0], "config": key[1], "error": errors[key]})
            continue
        row = summarize(key[0], key[1], runs[key])
        info = infos[key]
        row["wall_seconds"] = sum(i["wall_seconds"] for i in info)
        row["busy_before"] = [i["busy_before"] for i in info]
        row["waited_idle_seconds"] = sum(i["waited_idle_seconds"] for i in info)
        notes = [i["note"] for i in info if i.get("note")]
        if notes:
            row["note"] = "; ".join(notes)
        if info and info[0].get("server_profile"):
            row["server_profile"] = info[0]["server_profile"]
        if row.get("check") not in (None, "ok"):
            args.failed = True
        rows.append(row)
    return rows


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.failed = False
    children = Children()
    link = None

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    # also when started in the background by a shell (SIGINT inherited as ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log_root = tempfile.mkdtemp(prefix="bench_pushpull-")
    shapes = load_shapes()
    floats = sum(int(np.prod(s)) for s in shapes)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "model": MODEL, "tensors": len(shapes), "floats": floats, "bytes": floats * 4,
            "workers": 2, "servers": 1, "env": {k: v for k, v in os.environ.items()
                                                if k.startswith(("BYTEPS_", "BPS_GC_"))},
            "loadavg_before": os.getloadavg()}
    try:
        if args.shaped:
            netns = import_netns()
            NetnsUnavailable, ShapedLink = netns.NetnsUnavailable, netns.ShapedLink
            try:
                link = ShapedLink(args.shaped).__enter__()
            except NetnsUnavailable as e:
                print(f"bench_pushpull: --shaped {args.shaped} skipped: cannot set up network "
                      f"namespaces: {e}", flush=True)
                return 0
            topo = Shaped(link)
            meta["link"] = link.describe()
            print(f"shaped link: {link.describe()}", flush=True)
            rounds, warmup = args.shaped_rounds, args.shaped_warmup
            title_where = (f"shaped {args.shaped} (scheduler+server in {link.ns['srv']}, "
                           f"workers in {link.ns['wrk']})")
        else:
            topo = Loopback()
            rounds, warmup = args.rounds, args.warmup
            title_where = "loopback 127.0.0.1"
        meta.update(rounds=rounds, warmup=warmup, passes=args.passes, topology=topo.name)
        rows = run_all(args, topo, children, log_root)
        if link is not None:
            meta["qdisc_stats"] = {side: link.qdisc_stats(side) for side in ("srv", "wrk")}
        meta["loadavg_after"] = os.getloadavg()
        passes = f" x {args.passes} interleaved passes" if args.passes > 1 else ""
        title = (f"\npush_pull, {title_where}: 2 workers + 1 server, {MODEL} gradients "
                 f"({len(shapes)} tensors, {floats / 1e6:.2f}M floats, {floats * 4 / 1e6:.1f} MB); "
                 f"worker 0's median of {rounds} rounds after {warmup} warm-up{passes}")
        table = print_table(title, rows, topo.name, link is not None)
        print(f"load average before/after: {meta['loadavg_before'][0]:.2f} / "
              f"{meta['loadavg_after'][0]:.2f} (machine has {os.cpu_count()} CPUs)")
        for r in rows:
            if args.passes > 1 and not r.get("error"):
                print(f"  {r['system']} {r['config']}: per-pass medians "
                      f"{', '.join(f'{m:.3f}' for m in r['pass_medians'])} s")
        for r in rows:
            if r.get("system") == "bps_gc" and not r.get("error") and "compress_seconds" in r:
                print(f"  bps_gc {r['config']}: per round on worker 0: issuing push_pulls "
                      f"{r['issue_seconds']:.3f} s, compress (pool threads, summed) "
                      f"{r['compress_seconds']:.3f} s, waiting {r['wait_seconds']:.3f} s")
        for r in rows:
            for key in ("worker0_profile", "server_profile"):
                if r.get(key):
                    print(f"\n=== profile: {r['system']} {r['config']} "
                          f"{key.replace('_profile', '')}\n{r[key]}")
        path = args.json or os.path.join(
            ROOT, "out", "bench_pushpull.json" if not args.shaped else
            f"bench_pushpull_{args.shaped}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json_atomic(path, {"meta": meta, "table": table, "results": rows})
        print(f"wrote {path}")
        return 1 if args.failed else 0
    except KeyboardInterrupt as e:
        print(f"\nbench_pushpull: interrupted ({str(e) or 'Ctrl-C'}); stopping", file=sys.stderr)
        return 130
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # let the clean-up finish
            signal.signal(signum, signal.SIG_IGN)
        children.stop_all()
        if link is not None:
            link.delete()
        if args.failed or args.keep_logs:
            print(f"logs kept in {log_root}", file=sys.stderr)
        else:
            shutil.rmtree(log_root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_bps-worker":
        bps_worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_mx-worker":
        mx_worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_profiled-node":
        profiled_node(sys.argv[2:])
    else:
        sys.exit(main())

