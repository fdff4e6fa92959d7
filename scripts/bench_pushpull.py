#!/usr/bin/env python3
"""Side-by-side benchmark on one link and rank count: PyTorch's gloo all_reduce and DDP hooks,
bps_gc's collective transport, bps_gc's parameter server and MXNet's ps-lite, every
configuration interleaved in one run.

ResNet-50 v1b gradients (tests/data/resnet50_shapes.json: 161 float32 tensors, 25.56M floats,
102.2 MB), random normal * 1e-3, made once per rank and reduced every round; the time reported
is rank 0's median s/round over the timed rounds of every pass (after warm-up rounds).

Rows:
  torch ...              scripts/bench_collective.py's ranks: gloo all_reduce dense (25 MB
                         buckets), DDP dense / fp16 hook / PowerSGD rank 1, 4 (torch's hooks)
  bps_gc collective X    bps_gc push_pull of the 161 gradients on the torch.distributed
                         transport, codec X (same process group, same ranks)
  bps_gc DDP hook X      DDP with bps_gc.torch.comm_hook(X)
  bps_gc PS X            bps_gc on the parameter server, codec X (bench_common.BPS_CONFIGS:
                         BytePS's codecs and issue 11's that go through push_pull);
                         `dense (local reduce)` runs its cluster with BPS_GC_LOCAL_REDUCE=1: the
                         workers, all on one host, sum in shared memory (loopback only);
                         `dense (host's TCP congestion control)` runs with
                         BPS_GC_TCP_CONGESTION=system: its links keep the machines' default
                         instead of cubic (--shaped only)
  ps-lite X              mx.kv.create('dist_sync'), dense and 2bit
Several ranks per machine (--local-ranks L, issue 25): each worker machine runs L ranks, started
the way users start them: one bpslaunch per machine with NVIDIA_VISIBLE_DEVICES=0..L-1 and
DMLC_WORKER_ID = the machine (DMLC_NUM_WORKER counts machines; the scheduler and servers get no
BYTEPS_LOCAL_SIZE), torch's ranks with torchrun's RANK/LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK.
gloo's all_reduce and DDP run flat over all M*L ranks; bps_gc's collective and parameter
server run two levels (`dense (flat)`: BPS_GC_HIERARCHY=flat, every rank pushes its own copy).
With L > 1 a last row, `host level floor`, is the host level's memory work alone on this box
(scripts/bench_host_floor.py: M x L processes copying in, summing and copying out the same bytes
in shared memory, no codec, no network); with --baseline each compressed row's baseline plus
that floor is printed: the least two levels can take on these cores.
--elements N / --tensor-mb MB replace ResNet-50's gradients by one float32 matrix (issue 25:
--tensor-mb 25.6). --baseline JSON prints each row's ratio to the same row of an earlier run
(e.g. --local-ranks 1 against 4: compressed rows within 1.5x).

    python scripts/bench_pushpull.py --shaped 1gbit --ranks 2 --local-ranks 4 --tensor-mb 25.6

Topologies (the `topology` column): L ranks per machine; parameter-server servers either one
per worker machine (`colocated`, BytePS's mode; default) or each on its own machine
(`separate`); the scheduler on machine 0. On loopback every machine is 127.0.0.1. With
--shaped RATE (root) each machine is a network namespace whose NIC (a veth on a bridge) is
shaped with tc tbf to RATE in both directions (scripts/netns.py SwitchedMachines).

    python scripts/bench_pushpull.py --ranks 2                      # loopback
    python scripts/bench_pushpull.py --ranks 4 --shaped 1gbit
    python scripts/bench_pushpull.py --shaped 100mbit --rounds 2 --warmup 1
    python scripts/bench_pushpull.py --quick                        # smoke run

Columns: s/round (min, max), push/pull MB/w (bytes per round per worker as bps_gc counts them),
NIC MB/m0 (--shaped: bytes through machine 0's NIC per round, both directions, with its
co-located server's), floor s (--shaped: the line rate's time for the bytes a parameter-server
row's design moves through a machine's NIC: 2 x (M-1)/M x what the machine's ranks push, with
two levels one copy of the tensor, flat one per rank; other rows, marked *: for the bytes
machine 0's NIC moved, its busier direction), CPU% (whole machine during rank 0's timed rounds; 100 = CPU-bound or
other jobs running), vs gloo and vs PSGD r1 (ratios to torch's gloo all_reduce and DDP PowerSGD
rank 1 of the same run). Then the issues' targets with their ratios. JSON goes to
out/bench_pushpull_<link>_<ranks>.json unless --json says otherwise. Every child process is
started and stopped by bps_gc's launcher supervisor; the namespaces are always deleted.
BYTEPS_* / BPS_GC_* variables are passed on and recorded in the JSON. --profile cProfiles every
thread of bps_gc's worker 0 and of the servers and prints the top functions; with
BENCH_PROFILE_DIR=DIR each also writes its threads' raw stats and getrusage there
(scripts/bench_calls.py compares two versions' so).

Every system starts each timed round with a barrier outside the timing (torch: dist.barrier(),
bps_gc: bps.barrier(), ps-lite: kv._barrier()), so a round is timed from a common start.
--shaped rows also record each machine's TCP retransmissions and timeouts per round
(tcp_per_round in the JSON). BENCH_TRACE=PREFIX makes bps_gc's workers sample their machine's
NIC counters every 10 ms and write PREFIX.<config>.w<rank>.json; scripts/plot_nic_trace.py
plots them.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile

import numpy as np

from bench_cluster import PLACEMENTS, Children, Loopback, Switched, machines_needed
from bench_common import BPS_CONFIGS, LOCAL_RANKS_ONLY, MODEL, bps_gc_congestion, check_tcp_congestion, ONE_HOST_ONLY, PSLITE_CONFIGS, SHAPED_ONLY, QUICK_BPS, QUICK_PSLITE, ROOT, import_netns, interrupt_on_signals, load_shapes, machine_info, shapes_description, tear_down, write_json_atomic
from bench_report import print_table, same_rows, targets
from bench_run import run_all
from bench_workers import bps_worker, mx_worker, profiled_node


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="worker machines (2); each runs --local-ranks ranks")
    p.add_argument("--local-ranks", type=int, default=1, metavar="L", help="ranks per worker machine "
                   "(1): the parameter server's bpslaunch gets NVIDIA_VISIBLE_DEVICES=0..L-1 (the "
                   "scheduler and servers are not told), torch's ranks LOCAL_RANK/LOCAL_WORLD_SIZE")
    p.add_argument("--placement", default="colocated",
                   help=f"comma-separated server placements: {', '.join(PLACEMENTS)} (colocated)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (loopback 5, --shaped 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (loopback 2, --shaped 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up + 2 rounds, a few rows")
    p.add_argument("--tensors", type=int, default=0, help="only the first N tensors (0: all 161)")
    p.add_argument("--elements", type=int, default=0, metavar="N", help="one float32 tensor of N "
                   "elements (a matrix) instead of ResNet-50's gradients")
    p.add_argument("--tensor-mb", type=float, default=0, metavar="MB",
                   help="as --elements, given in MB of float32 (25.6: 6.4M elements)")
    p.add_argument("--baseline", metavar="JSON", help="an earlier run's JSON (e.g. at --local-ranks "
                   "1): print each row's ratio to the same row there")
    p.add_argument("--shaped", metavar="RATE", help="one network namespace per machine, NICs shaped "
                   "to RATE (1gbit, 100mbit, ...) instead of loopback; needs root")
    p.add_argument("--tcp-congestion", metavar="NAME", help="--shaped: every machine's default TCP "
                   "congestion control (what torch's gloo and ps-lite use; bps_gc's own links use "
                   "BPS_GC_TCP_CONGESTION); default: what a new namespace inherits from the host")
    p.add_argument("--passes", type=int, default=1,
                   help="run the whole list this many times, interleaved, pooling the rounds (1)")
    p.add_argument("--configs", help=f"comma-separated bps_gc PS configurations (default all: "
                                     f"{', '.join(BPS_CONFIGS)}; 'none' for none)".replace("%", "%%"))
    p.add_argument("--pslite", default=None, help="comma-separated ps-lite configurations "
                                                  "(dense,2bit; 'none' for none)")
    p.add_argument("--collective-rows", default=None, help="the torch.distributed block's rows: "
                   "'none', or only labels containing one of these comma-separated words")
    p.add_argument("--timeout", type=float, default=None, help="seconds per configuration")
    p.add_argument("--json", help="where to write the results")
    p.add_argument("--profile", action="store_true",
                   help="cProfile bps_gc's worker 0 and server 0 (all threads) and print the top")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S", help="before each "
                   "configuration wait up to S s until the CPUs are <= 25%% busy (0)")
    p.add_argument("--keep-logs", action="store_true", help="keep the children's logs")
    p.add_argument("--no-host-floor", action="store_true", help="--local-ranks > 1: skip the "
                   "host-level floor row (bench_host_floor.py: the host level's memory work alone)")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.shaped or args.quick else 2
    if args.rounds is None:
        args.rounds = 2 if args.shaped or args.quick else 5
    if args.quick and args.collective_rows is None:
        args.collective_rows = "all_reduce,PowerSGD rank 1,collective topk"
    if args.ranks < 2 or args.rounds < 1 or args.passes < 1 or args.warmup < 0 or args.local_ranks < 1:
        p.error("--ranks must be >= 2, --rounds and --passes >= 1, --local-ranks >= 1, --warmup >= 0")
    if args.tensor_mb:
        if args.elements:
            p.error("give --elements or --tensor-mb, not both")
        args.elements = int(round(args.tensor_mb * 1e6 / 4))
    if args.elements < 0 or (args.elements and args.tensors):
        p.error("--elements must be >= 0 and does not go with --tensors")
    if args.baseline:
        try:
            with open(args.baseline) as f:
                args.baseline_rows = json.load(f)["results"]
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--baseline {args.baseline}: not a bench_pushpull JSON ({e})")
    args.placements = pick(p, args.placement, PLACEMENTS, None, "--placement")
    args.bps = pick(p, args.configs, BPS_CONFIGS, QUICK_BPS if args.quick else None, "--configs")
    if args.configs is None:  # one machine per worker: nothing to sum locally; on loopback: no TCP
        drop = ONE_HOST_ONLY if args.shaped or args.local_ranks > 1 else SHAPED_ONLY
        if args.local_ranks == 1:
            drop += LOCAL_RANKS_ONLY
        if args.shaped and machines_congestion(args) == bps_gc_congestion():  # the same as dense
            drop += SHAPED_ONLY
        args.bps = [c for c in args.bps if c not in drop]
    if args.local_ranks == 1 and any(c in LOCAL_RANKS_ONLY for c in args.bps):
        print(f"bench_pushpull: {', '.join(LOCAL_RANKS_ONLY)} is dense with one rank per machine: skipped", flush=True)
        args.bps = [c for c in args.bps if c not in LOCAL_RANKS_ONLY]
    args.mx = pick(p, args.pslite, PSLITE_CONFIGS, QUICK_PSLITE if args.quick else None, "--pslite")
    if args.mx and args.local_ranks > 1:
        print("bench_pushpull: ps-lite rows run one rank per machine only: skipped", flush=True)
        args.mx = []
    if args.mx:
        try:
            import mxnet  # noqa: F401  (ps-lite rows only where MXNet is installed)
        except ImportError:
            print("bench_pushpull: no mxnet here: ps-lite rows skipped", flush=True)
            args.mx = []
    if args.shaped:
        try:
            args.rate_bits = import_netns().parse_rate(args.shaped)
        except ValueError as e:
            p.error(f"--shaped: {e}")
        args.shaped = args.shaped.lower()
    check_tcp_congestion(p, args)
    return args


def machines_congestion(args):
    """The --shaped machines' default TCP congestion control: --tcp-congestion, else what a
    new namespace inherits (the host's)."""
    if args.tcp_congestion:
        return args.tcp_congestion
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return None


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


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.failed = False
    children = Children()
    net = None

    interrupt_on_signals()
    log_root = tempfile.mkdtemp(prefix="bench_pushpull-")
    shapes = load_shapes(args.tensors, args.elements)
    floats = sum(int(np.prod(s)) for s in shapes)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": sys.argv,
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "model": MODEL, "tensors": len(shapes), "floats": floats, "bytes": floats * 4,
            "ranks": args.ranks, "local_ranks": args.local_ranks, "elements": args.elements,
            "machine": machine_info(), "placements": args.placements, "rounds": args.rounds,
            "warmup": args.warmup, "passes": args.passes, "loadavg_before": os.getloadavg(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("BYTEPS_", "BPS_GC_"))}}
    try:
        if args.shaped:
            netns = import_netns()
            machines = machines_needed(args.ranks, args.placements)
            try:
                net = netns.SwitchedMachines(args.shaped, machines, congestion=args.tcp_congestion).__enter__()
            except netns.NetnsUnavailable as e:
                print(f"bench_pushpull: --shaped {args.shaped} skipped: cannot set up network "
                      f"namespaces: {e}", flush=True)
                return 0
            topo = Switched(net)
            meta["link"] = net.describe()
            meta["tcp_congestion_default"] = net.default_congestion()
            meta["bps_gc_tcp_congestion"] = bps_gc_congestion()
            print(f"shaped: {net.describe()}; bps_gc's links: {meta['bps_gc_tcp_congestion'] or 'the default'}", flush=True)
        else:
            topo = Loopback()
        meta["topology"] = topo.name
        rows = run_all(args, topo, children, log_root)
        if args.local_ranks > 1 and not args.no_host_floor:  # the memory work of two levels alone
            from bench_host_floor import measure_host_floor
            floor = measure_host_floor(args.ranks, args.local_ranks, floats, args.rounds, args.warmup)
            if floor is not None:
                rows.append(floor)
                meta["host_level_floor"] = {k: floor[k] for k in ("seconds", "min", "max", "rounds")}
        if net is not None:
            meta["qdisc_stats"] = {m: net.qdisc_stats(m) for m in range(len(net.ns))}
        meta["loadavg_after"] = os.getloadavg()
        passes = f" x {args.passes} interleaved passes" if args.passes > 1 else ""
        ranks = (f"{args.ranks} machines x {args.local_ranks} ranks" if args.local_ranks > 1
                 else f"{args.ranks} ranks (one per machine)")
        title = (f"\n{topo.name}, {ranks}, {shapes_description(shapes, args.elements)}; "
                 f"{meta['machine']}; rank 0's median of "
                 f"{args.rounds} rounds after {args.warmup} warm-up{passes}; "
                 f"load average {meta['loadavg_before'][0]:.2f} -> {meta['loadavg_after'][0]:.2f} "
                 f"on {os.cpu_count()} CPUs")
        table = print_table(title, rows, topo.name, net is not None, getattr(args, "baseline_rows", None))
        for r in rows:
            for key in ("worker0_profile", "server_profile"):
                if r.get(key) and r["system"] == "bps_gc PS":
                    print(f"\n=== profile: {r['system']} {r['config']} "
                          f"{key.replace('_profile', '')}\n{r[key]}")
        shape = f"{args.ranks}x{args.local_ranks}" if args.local_ranks > 1 else f"{args.ranks}"
        path = args.json or os.path.join(ROOT, "out", f"bench_pushpull_{topo.name}_{shape}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        report = {"meta": meta, "table": table, "results": rows, "targets": targets(rows, topo.name)}
        if getattr(args, "baseline_rows", None) is not None:
            report["against_baseline"] = {"baseline": args.baseline,
                                          "rows": same_rows(rows, args.baseline_rows)}
        write_json_atomic(path, report)
        print(f"wrote {path}")
        return 1 if args.failed else 0
    except KeyboardInterrupt as e:
        print(f"\nbench_pushpull: interrupted ({str(e) or 'Ctrl-C'}); stopping", file=sys.stderr)
        return 130
    finally:
        tear_down(children, net)
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
