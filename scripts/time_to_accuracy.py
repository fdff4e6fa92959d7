#!/usr/bin/env python3
"""Time to accuracy on the MNIST demo's task (--task mnist, the default; --task lm: a small GPT on
real text, scripts/time_to_accuracy_lm.py) (MLP 784-128-10, the 4,000 real training digits
of example/demo, 1,000 held out), 2 machines x --local-ranks ranks, batch 32 per rank, SGD lr 0.1 momentum 0.9:
PyTorch's DDP (dense, fp16 hook, PowerSGD rank 1 and 4, torch's own hooks) against bps_gc on
the collective transport (its DDP hook; DistributedOptimizer with the demo's onebit recipe)
and on the parameter server (the same recipe; one server per worker machine, co-located).

Two machines of --local-ranks ranks each (1): on loopback both are 127.0.0.1; with --shaped
RATE (root) each is a network namespace whose NIC is shaped to RATE both ways
(scripts/netns.py SwitchedMachines). With several local ranks the torch.distributed ranks get
torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK (bps_gc's collective then runs two levels)
and each machine's parameter-server workers are one bpslaunch with NVIDIA_VISIBLE_DEVICES=0..L-1
(the scheduler and servers are not told; the servers sum one push per machine).
The torch.distributed configurations train one after the other in the same rank processes;
the parameter-server one in a second cluster (scheduler, 2 servers, 2 workers) on the same
link. Rank 0 evaluates every --eval-every steps with the clock stopped. The table gives, for
each, the wall time to first reach the dense run's final accuracy (minus --slack), its final
accuracy and its speed-up against the fastest DDP configuration; the plot shows accuracy
against wall time. The limit row: DDP dense's steps to the target x the compute-only time of
one step (forward, backward and optimizer, no exchange), timed on the same ranks before the
configurations train.

    python scripts/time_to_accuracy.py                     # loopback, 10 epochs
    sudo python scripts/time_to_accuracy.py --shaped 100mbit
    sudo python scripts/time_to_accuracy.py --shaped 100mbit --rows PowerSGD,fp16,thc   # issue 35
    python scripts/time_to_accuracy.py --epochs 1 --out /tmp/tta
    sudo python scripts/time_to_accuracy.py --task lm --shaped 10mbit --out out/runs/tta_lm_10mbit
    sudo python scripts/time_to_accuracy.py --task lm --shaped 10mbit --rows DiLoCo   # issue 44
    sudo python scripts/time_to_accuracy.py --task lm --hsdp --local-ranks 2 --shaped 100mbit   # issue 42
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import PY, ROOT, bps_gc_congestion, check_tcp_congestion, import_netns, machine_info  # noqa: E402  (puts this checkout first)

# bps_gc's DistributedOptimizer recipes (the momentum moves into the codec chain, as in the demo)
RECIPES = {"onebit + EF + nesterov": {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"},
           "topk 1% + EF + nesterov": {"compressor": "topk", "k": 0.01, "ef": "vanilla", "momentum": "nesterov"},
           # issue 35: summed 4-bit codes; the optimizer keeps its momentum (thc takes no decorator)
           "thc 4-bit + EF": {"compressor": "thc", "bits": 4, "feedback": True}}
# bps_gc's DDP hook rows
HOOKS = {"bps_gc hook topk 10% + EF": {"compressor": "topk", "k": 0.1, "ef": "vanilla"},
         "bps_gc hook thc 4-bit + EF": {"compressor": "thc", "bits": 4, "feedback": True}}
COLLECTIVE = ("DDP dense", "DDP fp16 hook", "DDP PowerSGD rank 1", "DDP PowerSGD rank 4",
              *HOOKS, *(f"bps_gc collective {r}" for r in RECIPES))
PS = tuple(f"bps_gc PS {r}" for r in RECIPES)
MACHINES = 2
LIMIT = "the limit (no exchange)"
TIMED_STEPS = 50  # MNIST: compute-only steps timed for the limit row


def parse_args(argv=None):
    import time_to_accuracy_lm
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=("mnist", "lm"), default="mnist")
    p.add_argument("--epochs", type=int, default=10, help="mnist: epochs")
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (mnist 10, lm 25)")
    p.add_argument("--local-ranks", type=int, default=1, metavar="L", help="ranks per machine (1)")
    p.add_argument("--machines", type=int, default=MACHINES, metavar="M",
                   help=f"lm: machines, each a replica of DDP or DiLoCo ({MACHINES}; the HSDP rows: 2)")
    p.add_argument("--slack", type=float, default=None, help="mnist: target = dense final accuracy - slack "
                   "(0); lm: target = the reference's final validation loss + slack (0.02 nats per byte)")
    p.add_argument("--shaped", metavar="RATE", help="one namespace per rank, NICs shaped to RATE (root)")
    p.add_argument("--tcp-congestion", metavar="NAME", help="--shaped: the machines' default TCP congestion "
                   "control (what DDP's gloo uses; bps_gc's own links use BPS_GC_TCP_CONGESTION)")
    p.add_argument("--rows", default=None, help="only configurations whose name contains one of "
                   "these comma-separated words (DDP dense always runs: it sets the target)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "time_to_accuracy"))
    p.add_argument("--report", metavar="JSON", help="lm: print the table (and write JSON and plot to --out) "
                   "of an earlier run's time_to_accuracy.json, with its flags given again; runs nothing")
    p.add_argument("--hsdp", action="store_true", help="lm: the HSDP rows instead (time_to_accuracy_hsdp.py; "
                   "--local-ranks >= 2 ranks a machine shard the model)")
    p.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--configs", default=None, help=argparse.SUPPRESS)  # a rank's share
    time_to_accuracy_lm.add_args(p)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.eval_every = args.eval_every or (10 if args.task == "mnist" else 25)
    args.slack = args.slack if args.slack is not None else (0.0 if args.task == "mnist" else 0.02)
    if args.task == "lm":
        from lm_training import check_args
        check_args(args, p)
    check_tcp_congestion(p, args)
    if args.local_ranks < 1:
        p.error("--local-ranks must be >= 1")
    if args.machines < 2 or (args.machines != MACHINES and (args.task != "lm" or args.hsdp)):
        p.error(f"--machines must be >= 2, and other than {MACHINES} for --task lm's data-parallel and DiLoCo rows "
                f"only, got {args.machines}")
    if args.hsdp and (args.task != "lm" or args.local_ranks < 2):
        p.error("--hsdp needs --task lm and --local-ranks >= 2 (a machine's ranks shard the model)")
    if args.task == "lm":
        time_to_accuracy_lm.check_diloco_args(args, p)
    return args


def rank_main(args):
    import numpy as np
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, os.path.join(ROOT, "example", "demo"))
    import bps_gc.torch as bps
    from mnist_worker import accuracy, load_data, network

    torch.set_num_threads(1)
    bps.init()
    rank, size = bps.rank(), bps.size()
    x, y, xv, yv = load_data(4000)
    shard = np.arange(rank, len(x), size)
    per_epoch = len(x) // size // 32
    curves = {}
    compute = compute_only_seconds(bps, network, x, y, shard, rank) if "DDP dense" in args.configs.split(",") else None
    for config in args.configs.split(","):
        model = network(128, 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                              nesterov="nesterov" in config)
        if config.startswith(("bps_gc collective", "bps_gc PS")):
            # the momentum moves into the codec chain before the compressor (the demo's recipe)
            opt = bps.DistributedOptimizer(opt, named_parameters=[(f"{config}.{n}", p) for n, p in model.named_parameters()],
                                           compression_params=RECIPES[config.split(" ", 2)[2]])
            net = model
        else:
            net = DDP(model)
            if config == "DDP fp16 hook":
                net.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif config.startswith("DDP PowerSGD"):
                state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(config[-1]),
                                                    start_powerSGD_iter=2)
                net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            elif config.startswith("bps_gc hook"):
                net.register_comm_hook(None, bps.comm_hook(HOOKS[config], optimizer=opt))
        curve, clock, step = [(0.0, accuracy(model, xv, yv), 0)], 0.0, 0
        bps.barrier()
        for epoch in range(args.epochs):
            order = np.random.default_rng(epoch).permutation(shard)
            for start in range(0, per_epoch * 32, 32):
                began = time.perf_counter()
                batch = order[start:start + 32]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
                opt.step()
                clock += time.perf_counter() - began
                step += 1
                if step % args.eval_every == 0:
                    if rank == 0:
                        curve.append((clock, accuracy(model, xv, yv), step))
                    bps.barrier()  # the clock is stopped while rank 0 evaluates
        if rank == 0:
            curve.append((clock, accuracy(model, xv, yv), step))
            curves[config] = curve
            print(f"{config}: {clock:.2f} s, accuracy {curve[-1][1]:.4f}", flush=True)
    if rank == 0:
        json.dump({"curves": curves, "compute_seconds_per_step": compute}, open(args.rank_out, "w"))
    bps.shutdown()


def compute_only_seconds(bps, network, x, y, shard, rank):
    """The mean over the ranks of one step's forward, backward and SGD step with no exchange
    (the limit row's step time): the median of TIMED_STEPS steps of a fresh model on this rank's
    batches (the other jobs' bursts on a shared box are not this model's cost)."""
    import statistics
    import numpy as np
    import torch
    model = network(128, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = np.random.default_rng(rank).permutation(shard)
    bps.barrier()
    seconds = []
    for i in range(TIMED_STEPS):
        began = time.perf_counter()
        batch = order[(i * 32) % (len(order) - 32):][:32]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step()
        seconds.append(time.perf_counter() - began)
    mine = statistics.median(seconds)
    return bps.push_pull(torch.tensor([mine], dtype=torch.float64), average=True, name="tta.compute").item()


def run_clusters(args, topo, log_dir):
    """The torch.distributed ranks, then the parameter-server cluster; rank 0's curves."""
    from bench_cluster import Children, ClusterFailed, RowsProgress, child_env, cluster_env, failure_lines, node_plan, \
        run_cluster, worker_env
    children = Children()
    def wanted(name):  # DDP dense (mnist) and the reference (lm) set the target
        return name in ("DDP dense", "reference") or not args.rows or any(w in name for w in args.rows.split(","))

    import time_to_accuracy_lm as lm
    rows = {"mnist": (("collective", COLLECTIVE), ("ps", PS)), "lm": (("collective", lm.collective_rows(args)), ("ps", lm.PS))}
    runs = [(transport, [c for c in configs if wanted(c)]) for transport, configs in rows[args.task]]
    if args.hsdp:  # the limit and native HSDP (the target) always run
        import time_to_accuracy_hsdp as hsdp
        runs = [("collective", list(hsdp.rows(lambda name: not args.rows or
                                              any(w in name for w in args.rows.split(",")))))]
    results = {}
    # rank 0 prints "<row>: ..." as each row ends (the lm task's reference prints none)
    progress = RowsProgress([c for _, configs in runs for c in configs if c != lm.REFERENCE])
    try:
        for transport, configs in runs:
            if not configs:
                continue
            progress.follow(os.path.join(log_dir, "rank0.log"), f"rows ({transport})")
            raw = os.path.join(log_dir, f"{transport}.json")
            cmd = [PY, os.path.abspath(__file__), *args.argv, "--rank-out", raw, "--configs", ",".join(configs)]
            if args.task == "lm" and transport == "ps":  # the collective run's reference set them
                target, _, _, cap = lm.targets(results["reference"], args)
                cmd += ["--target", repr(target), "--cap-seconds", repr(cap)]
            port, local = topo.port(), args.local_ranks
            if transport == "collective":
                plan = [(f"rank{r}", topo.wrap(r // local, cmd), child_env(
                    {"RANK": str(r), "WORLD_SIZE": str(args.machines * local), "LOCAL_RANK": str(r % local),
                     "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(r // local),
                     "MASTER_ADDR": topo.host(0), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                     "GLOO_SOCKET_IFNAME": topo.veth(r // local) or "lo", "BPS_GC_TRANSPORT": "collective",
                     "BPS_GC_TTA_HOST": topo.host(r // local)}))  # lm: torchft's row's own address
                    for r in range(args.machines * local)]
            else:  # one bpslaunch per machine, as on a cluster; its ranks are its children
                common = {**cluster_env(topo, args.machines, args.machines, port), "OMP_NUM_THREADS": "1",
                          "BPS_GC_TRANSPORT": "ps",  # lm: every tensor compressed, as the hook rows do
                          **({"BYTEPS_MIN_COMPRESS_BYTES": "0"} if args.task == "lm" else {})}
                plan = node_plan(topo, common, list(range(args.machines)), [PY, "-m", "bps_gc.launcher.cli"])
                plan += [(f"rank{w}", topo.wrap(w, [PY, "-m", "bps_gc.launcher.cli", *cmd]),
                          child_env(worker_env(topo, common, w, local))) for w in range(args.machines)]
            try:
                run_cluster(children, plan, {name for name, _, _ in plan if name.startswith("rank")}, 3600, log_dir,
                            progress)
            except ClusterFailed as e:
                sys.exit(f"time_to_accuracy: the {transport} run failed: {failure_lines(e, 3000)}")
            merge(results, json.load(open(raw)))
    finally:
        progress.close()
        children.stop_all()
    return results


def merge(results, rank_out):
    """One transport's rank-0 output into the run's: curves / rows merged, the rest kept."""
    for key, value in rank_out.items():
        if isinstance(value, dict) and key in ("curves", "rows"):
            results.setdefault(key, {}).update(value)
        elif value is not None:
            results[key] = value


def time_to(curve, target):
    return next(((t, step) for t, acc, step in curve if acc >= target), (None, None))


def ranks_of(args):
    return f"{args.machines} machines x {args.local_ranks} ranks" if args.local_ranks > 1 else f"{args.machines} ranks"


def save(args, summary, series, target, ylabel, ylim=None):
    """time_to_accuracy.json (the summary) and time_to_accuracy.png: ``series`` {name: (xs, ys)}
    against training wall time, the target as a dotted line."""
    json.dump(summary, open(os.path.join(args.out, "time_to_accuracy.json"), "w"), indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.get_cmap("tab20").colors  # 15 rows and more: matplotlib's default 10 colours repeat
    for i, (name, (xs, ys)) in enumerate(series.items()):
        style = {"linestyle": "--", "color": "black"} if name == LIMIT else {"color": colors[i % len(colors)]}
        ax.plot(xs, ys, label=name, **style)
    ax.axhline(target, color="grey", linestyle=":", label="target")
    ax.set_xlabel("training wall time (s), rank 0")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{'GPT on stdlib bytes' if args.task == 'lm' else 'MNIST MLP'}, {ranks_of(args)}, "
                 f"{args.shaped or 'loopback'}", fontsize=9)
    if ylim:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the curves, not over them
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "time_to_accuracy.png"), dpi=120)
    print(f"JSON and plot: {args.out}/time_to_accuracy.json, time_to_accuracy.png")


def main(argv=None):
    args = parse_args(argv)
    if args.rank_out:
        if args.hsdp:
            import time_to_accuracy_hsdp
            return time_to_accuracy_hsdp.rank_main(args)
        if args.task == "lm":
            import time_to_accuracy_lm
            return time_to_accuracy_lm.rank_main(args)
        return rank_main(args)
    from bench_cluster import Loopback, Switched
    os.makedirs(args.out, exist_ok=True)
    if args.report and args.task == "lm":
        import time_to_accuracy_lm
        return time_to_accuracy_lm.report_again(args)
    if args.task == "lm":
        import time_to_accuracy_lm
        time_to_accuracy_lm.check_corpus(args)
    net, where = None, "loopback"
    if args.shaped:
        netns = import_netns()
        try:
            net = netns.SwitchedMachines(args.shaped, args.machines, congestion=args.tcp_congestion).__enter__()
            where = (f"{args.shaped} shaped (one namespace per machine; {net.describe()}; bps_gc's links: "
                     f"{bps_gc_congestion() or 'the default'})")
        except netns.NetnsUnavailable as e:
            print(f"time_to_accuracy: cannot shape a link here ({e}); running on loopback")
    try:
        with tempfile.TemporaryDirectory(prefix="tta-") as log_dir:
            results = run_clusters(args, Switched(net) if net else Loopback(), log_dir)
    finally:
        if net is not None:
            net.delete()
    if args.hsdp:
        import time_to_accuracy_hsdp
        return time_to_accuracy_hsdp.report(args, results, where)
    if args.task == "lm":
        import time_to_accuracy_lm
        return time_to_accuracy_lm.report(args, results, where)
    report(args, results, where)


def report(args, results, where):
    curves, compute = results["curves"], results["compute_seconds_per_step"]
    target = curves["DDP dense"][-1][1] - args.slack
    rows = {}
    for name, c in curves.items():
        seconds, steps = time_to(c, target)
        rows[name] = {"seconds_to_target": seconds, "steps_to_target": steps, "final_accuracy": c[-1][1],
                      "train_seconds": c[-1][0]}
    ddp_steps = rows["DDP dense"]["steps_to_target"]
    rows[LIMIT] = {"seconds_to_target": ddp_steps * compute, "steps_to_target": ddp_steps,
                   "final_accuracy": None, "train_seconds": curves["DDP dense"][-1][2] * compute}
    limit = rows[LIMIT]["seconds_to_target"]
    ddp_times = [r["seconds_to_target"] for n, r in rows.items() if n.startswith("DDP") and r["seconds_to_target"]]
    print(f"{ranks_of(args)}, {where}, {args.epochs} epochs; {machine_info()}; target = dense DDP's final accuracy "
          f"{target:.4f}; the limit: DDP dense's {ddp_steps} steps x {compute * 1000:.2f} ms compute-only")
    print(f"{'':42} {'s to target':>11} {'x limit':>8} {'final acc':>9} {'train s':>8} {'vs fastest DDP':>14}")
    for name, r in rows.items():
        t = r["seconds_to_target"]
        r["speedup_vs_fastest_ddp"] = min(ddp_times) / t if t and ddp_times else None
        r["vs_limit"] = t / limit if t and limit else None
        shown = f"{t:11.2f}" if t is not None else f"{'never':>11}"
        speed = f"{r['speedup_vs_fastest_ddp']:.2f}x" if r["speedup_vs_fastest_ddp"] else "-"
        ratio = f"{r['vs_limit']:.2f}x" if r["vs_limit"] else "-"
        final = f"{r['final_accuracy']:9.4f}" if r["final_accuracy"] is not None else f"{'-':>9}"
        print(f"{name:42} {shown} {ratio:>8} {final} {r['train_seconds']:8.2f} {speed:>14}")
    summary = {"task": "mnist", "target": target, "epochs": args.epochs, "link": where, "command": sys.argv,
               "machines": args.machines, "local_ranks": args.local_ranks, "machine": machine_info(),
               "compute_seconds_per_step": compute, "rows": rows, "curves": curves}
    series = {name: ([t for t, _, _ in c], [a for _, a, _ in c]) for name, c in curves.items()}
    series[LIMIT] = ([limit, limit], [0.8, 1.0])
    save(args, summary, series, target, "validation accuracy", ylim=(0.8, 1.0))


if __name__ == "__main__":
    main()
