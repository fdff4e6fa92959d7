#!/usr/bin/env python3
"""DDP communication hooks side by side, 2 ranks (gloo), one rank per machine: bps_gc's
comm_hook (which returns at once and reduces on its own thread) against PyTorch's own hooks, on
an MLP (--width x --layers, batch --batch per rank) whose backward and compressed reduction
take similar time. With --shaped RATE (root) each rank is a network namespace whose NIC is
shaped to RATE both ways (scripts/netns.py SwitchedMachines); else both are on loopback.

Rows (rank 0's median step over --rounds after --warmup, the rows taking turns each round; a
step is forward, backward, SGD;
"in step()" is the median time inside the optimizer's step(), where DistributedOptimizer waits;
"cpu s" the median CPU seconds of rank 0's process per step, every thread):
  DDP no communication        a hook that returns the bucket unchanged: the floor
  DDP dense / fp16 hook       PyTorch's all_reduce and fp16_compress_hook
  DDP PowerSGD rank 1         PyTorch's powerSGD_hook (compressed from step 3 on, one bucket:
                              on gloo its phases of several buckets interleave differently on
                              each rank, bench_collective.py)
  bps_gc hook X               bps_gc.torch.comm_hook(X); "held" is the time inside the hook
                              call over the time until its future completes, summed over buckets
  X reduction alone           the same hook called directly on buckets of DDP's sizes, no
                              backward: time from the first call until the last future is done
  bps_gc DistributedOptimizer X
                              bps_gc.torch.DistributedOptimizer (collective transport): held is
                              the time inside push_pull_async (its gradient hooks) over the time
                              until each handle is synchronized; "(parameter server)": the same
                              on bps_gc's parameter server (2 servers, one on each machine)

    python scripts/bench_hook.py --quick                       # loopback smoke run
    python scripts/bench_hook.py --model resnet50-shapes       # ResNet-50's 161 gradients
    sudo python scripts/bench_hook.py --shaped 100mbit
    sudo python scripts/bench_hook.py --shaped 100mbit --rows "no comm,hook topk,alone" --timeline

--timeline: after the rounds, 5 more steps of the bps_gc hook's topk row and of its reduction
alone, rank 0 printing the last one's stamps per bucket (bps_gc.collective.exchange.driver.TIMELINE: hook call,
compressing, gathering, reducing; ms from the step's start) and the CPU per step of each of its
threads (/proc schedstat).

--model resnet50-shapes: instead of the MLP, a model holding ResNet-50 v1b's 161 parameters
(tests/data/resnet50_shapes.json, 25.6M floats) whose loss is one multiply-add per parameter
element against a fixed random tensor: DDP's buckets, the hooks and the optimizer see
ResNet-50's gradients, and the step is mostly communication and the codecs' own work.

Targets (issue 26): held <= 0.2 for topk 1% + EF; its step <= 1.15x max(no communication,
its reduction alone) and below PowerSGD rank 1. JSON goes to out/bench_hook.json unless --json.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import PY, ROOT, check_tcp_congestion, import_netns, load_shapes, write_json_atomic  # noqa: E402
from bench_hook_timeline import TRACED, print_timeline, thread_cpu  # noqa: E402
from bench_models import shapes_model  # noqa: E402

CODECS = {"topk 1% + EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"},
          "onebit + EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          "DGC 1%": {"compressor": "dgc", "k": 0.01}}
TARGET = "topk 1% + EF"
PS_ROW = f"bps_gc DistributedOptimizer {TARGET} (parameter server)"
ROWS = ("DDP no communication", "DDP dense", "DDP fp16 hook", "DDP PowerSGD rank 1",
        *(f"bps_gc hook {c}" for c in CODECS), f"{TARGET} reduction alone",
        f"bps_gc DistributedOptimizer {TARGET}", PS_ROW)
QUICK = ("DDP no communication", "DDP PowerSGD rank 1", f"bps_gc hook {TARGET}", f"{TARGET} reduction alone",
         f"bps_gc DistributedOptimizer {TARGET}", PS_ROW)
START_POWERSGD_ITER = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "resnet50-shapes"), default="mlp",
                   help="the MLP (--width, --layers, --batch), or ResNet-50's gradient shapes")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    # 112: the step without communication takes about as long as topk 1% + EF's reduction alone
    # at 100 Mbit/s (both about 0.05 s on the 2-core box of docs/ddp_hook.md; at 48 the reduction took 2x)
    p.add_argument("--batch", type=int, default=112, help="samples per rank and step")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="DDP's bucket_cap_mb")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="a few rows of a small model, 2 warm-up + 3 rounds")
    p.add_argument("--rows", default=None, help="only rows containing one of these comma-separated words")
    p.add_argument("--shaped", metavar="RATE", help="one namespace per rank, NICs shaped to RATE (root)")
    p.add_argument("--tcp-congestion", metavar="NAME", help="--shaped: the machines' default TCP congestion control")
    p.add_argument("--timeline", action="store_true",
                   help="after the rounds, print one step of the bps_gc hook's topk row and of its reduction "
                        "alone on rank 0: per bucket, when each stage started and ended "
                        "(bps_gc.collective.exchange.driver.TIMELINE), and each thread's CPU per step")
    p.add_argument("--json", default=os.path.join(ROOT, "out", "bench_hook.json"))
    p.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)  # set for the ranks
    p.add_argument("--rank-rows", default=None, help=argparse.SUPPRESS)  # their rows, as JSON
    args = p.parse_args(argv)
    check_tcp_congestion(p, args)
    if args.quick:
        args.width, args.layers, args.batch, args.warmup, args.rounds = 256, 3, 16, 2, 3
    return args


def selected(args):
    rows = QUICK if args.quick else ROWS
    return [r for r in rows if not args.rows or any(w in r for w in args.rows.split(","))]


# ---------------------------------------------------------------------------- ranks

class HeldClock:
    """Time inside a call against time until what it started completes, summed."""

    def __init__(self):
        self.held = self.total = 0.0

    def fraction(self):
        return self.held / self.total if self.total else None


def rank_main(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bps_gc.torch as bps
    from bps_gc.torch import ops

    torch.set_num_threads(1)
    bps.init()  # the collective transport (RANK, MASTER_ADDR...): DDP's default group, and the optimizer's
    rank = bps.rank()
    g = torch.Generator().manual_seed(rank)
    x, target = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)

    def mlp():
        torch.manual_seed(0)
        if args.model == "resnet50-shapes":
            return shapes_model(load_shapes(), rank)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])

    def loss_of(model):
        if args.model == "resnet50-shapes":
            return model()
        return torch.nn.functional.mse_loss(model(x), target)

    in_step = []  # seconds inside opt.step(): a DistributedOptimizer's exchanges wait there
    marks = []  # --timeline: (event, perf_counter) of the step being traced

    def stepper(model, opt):
        def step():
            opt.zero_grad()
            loss = loss_of(model)
            marks.append(("forward end", time.perf_counter()))
            loss.backward()
            marks.append(("backward end", time.perf_counter()))
            began = time.perf_counter()
            opt.step()
            in_step.append(time.perf_counter() - began)
        return step

    def held_hook(hook, clock, layout=None):
        """``hook``, timed: the call and its future; ``layout`` collects DDP's buckets' sizes."""
        def timed(state, bucket):
            if layout is not None:
                if bucket.index() == 0:  # a step's first bucket: the last step's layout only
                    layout.clear()
                layout[bucket.index()] = [t.numel() for t in bucket.gradients()]
            began = time.perf_counter()
            future = hook(state, bucket)
            held = time.perf_counter() - began

            def done(f):
                clock.held += held
                clock.total += time.perf_counter() - began
                return f.value()
            return future.then(done)
        return timed

    def unchanged(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    def ddp(hook=None, state=None, bucket_mb=args.bucket_mb):
        model = DDP(mlp(), bucket_cap_mb=bucket_mb)
        if hook is not None:
            model.register_comm_hook(state, hook)
        return stepper(model, torch.optim.SGD(model.parameters(), lr=0.01)), None

    def bps_hook(codec):
        clock = HeldClock()
        layouts[codec] = {}
        step, _ = ddp(held_hook(bps.comm_hook(CODECS[codec]), clock, layouts[codec]))
        return step, clock

    def reduction_alone(codec):
        """The hook on buckets of the sizes DDP gave the codec's row (or one per layer)."""
        sys.path.append(os.path.join(ROOT, "tests"))  # DDP's GradBucket has no constructor: the
        try:                                          # tests' stand-in calls the hook outside DDP
            from bps_gc.torch.ddp.hook import CompressionHook
            from grad_bucket import GradBucket
        except ImportError:  # a version before issue 43 (scripts/bench_versions.py runs this script on it)
            from bps_gc.torch.grad_bucket import GradBucket
            from bps_gc.torch.hook import CompressionHook
        layout = layouts.get(codec) or {i: [args.width * args.width, args.width] for i in range(args.layers)}
        hook = CompressionHook(CODECS[codec])
        buffers = {i: torch.randn(sum(sizes), generator=g) for i, sizes in layout.items()}

        def step():
            futures = [hook(None, GradBucket(i, layout[i], buffers[i].clone())) for i in sorted(layout)]
            torch.futures.wait_all(futures)
        return step, None

    def optimizer(codec):
        clock = HeldClock()
        model = mlp()
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=[(f"{codec}.{n}", p) for n, p in model.named_parameters()],
                                       compression_params=CODECS[codec])
        started = {}
        push, synchronize = ops.push_pull_async, ops.synchronize

        def timed_push(*a, **k):
            began = time.perf_counter()
            handle = push(*a, **k)
            started[handle] = (began, time.perf_counter() - began)
            return handle

        def timed_synchronize(handle):
            result = synchronize(handle)
            began, held = started.pop(handle)
            clock.held += held
            clock.total += time.perf_counter() - began
            return result
        ops.push_pull_async, ops.synchronize = timed_push, timed_synchronize
        return stepper(model, opt), clock

    def powersgd():
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=START_POWERSGD_ITER, use_error_feedback=True,
                                            warm_start=True)
        return ddp(powerSGD_hook.powerSGD_hook, state, bucket_mb=1024)

    layouts, original = {}, (ops.push_pull_async, ops.synchronize)
    builders = {"DDP no communication": lambda: ddp(unchanged), "DDP dense": lambda: ddp(),
                "DDP fp16 hook": lambda: ddp(default_hooks.fp16_compress_hook), "DDP PowerSGD rank 1": powersgd,
                **{f"bps_gc hook {c}": (lambda c=c: bps_hook(c)) for c in CODECS},
                f"{TARGET} reduction alone": lambda: reduction_alone(TARGET),
                f"bps_gc DistributedOptimizer {TARGET}": lambda: optimizer(TARGET), PS_ROW: lambda: optimizer(TARGET)}
    barrier = dist.barrier if dist.is_initialized() else bps.barrier  # the parameter server: no group
    rows = {}
    for label in json.loads(args.rank_rows):  # made and warmed up in order (reduction alone reads a layout)
        step, clock = builders[label]()
        for _ in range(max(args.warmup, START_POWERSGD_ITER + 1)):
            step()
        if clock is not None:
            clock.held = clock.total = 0.0
        rows[label] = (step, clock, [], [], [])
    for n in range(args.rounds):  # the rows take turns: a load that comes and goes hits all alike
        for step, _, times, waits, cpu in rows.values():
            in_step[:], marks[:] = [], []
            barrier()
            began, used = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - began)
            cpu.append(time.process_time() - used)  # every thread of this rank: backward, the hook's, gloo's
            waits.extend(in_step)
        if rank == 0:  # the driver's progress bar reads it in this rank's log
            print(f"{round_name(os.environ.get('BPS_GC_TRANSPORT'), n)}: {len(rows)} rows", flush=True)
    ops.push_pull_async, ops.synchronize = original  # the optimizer row timed them
    traced = {}
    if args.timeline:
        from bps_gc.collective.exchange import driver as hook_module
        for label in (f"bps_gc hook {TARGET}", f"{TARGET} reduction alone"):
            if label in rows:
                threads = thread_cpu()
                for _ in range(TRACED):  # the stamps of the last, the threads' CPU of all
                    hook_module.TIMELINE, marks[:] = [], []
                    barrier()
                    began, used = time.perf_counter(), time.process_time()
                    rows[label][0]()
                    marks.append(("step end", time.perf_counter()))
                    cpu = time.process_time() - used
                threads = {name: (ns - threads.get(name, 0)) / TRACED / 1e9 for name, ns in thread_cpu().items()}
                stamps, hook_module.TIMELINE = hook_module.TIMELINE, None
                traced[label] = {"began": began, "cpu_s": cpu, "marks": list(marks), "stamps": stamps,
                                 "thread_cpu_s": threads}
    results = [{"row": label, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                "times": times, "held": clock and clock.fraction(),
                "in_step_s": statistics.median(waits) if waits else None, "cpu_s": statistics.median(cpu),
                "timeline": traced.get(label)}
               for label, (_, clock, times, waits, cpu) in rows.items()]
    if rank == 0:
        json.dump(results, open(args.rank_out, "w"))
    bps.shutdown()


# ---------------------------------------------------------------------------- driver

def round_name(transport, n):
    """What rank 0 prints as round ``n`` of a transport's rows ends (the driver's progress bar)."""
    return f"{transport} round {n + 1}"


def run_ranks(args, topo, log_dir):
    """The torch.distributed rows in 2 ranks, then the parameter-server row in a cluster of
    its own (scheduler and a server on machine 0, a server on machine 1); rank 0's results."""
    from bench_cluster import Children, RowsProgress, child_env, cluster_env, node_plan, run_or_exit, \
        worker_env
    rows = selected(args)
    results = []
    runs = [(transport, mine) for transport, mine in (("collective", [r for r in rows if r != PS_ROW]),
                                                      ("ps", [r for r in rows if r == PS_ROW])) if mine]
    progress = RowsProgress([round_name(transport, n) for transport, _ in runs for n in range(args.rounds)], "rounds",
                            unit="round")
    for transport, mine in runs:
        raw = os.path.join(log_dir, f"{transport}.json")
        cmd = [PY, os.path.abspath(__file__), "--rank-out", raw, "--rank-rows", json.dumps(mine), "--model",
               args.model, "--width",
               str(args.width), "--layers", str(args.layers), "--batch", str(args.batch), "--bucket-mb",
               str(args.bucket_mb), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
               *(["--timeline"] if args.timeline else [])]
        port = topo.port()
        if transport == "collective":
            plan = [(f"rank{r}", topo.wrap(r, cmd), child_env(
                {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": topo.host(0), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                 "GLOO_SOCKET_IFNAME": topo.veth(r) or "lo", "BPS_GC_TRANSPORT": "collective"})) for r in range(2)]
        else:
            common = {**cluster_env(topo, 2, 2, port), "OMP_NUM_THREADS": "1", "BPS_GC_TRANSPORT": "ps"}
            plan = node_plan(topo, common, [0, 1], [PY, "-m", "bps_gc.launcher.cli"])
            plan += [(f"rank{w}", topo.wrap(w, [PY, "-m", "bps_gc.launcher.cli", *cmd]),
                      child_env(worker_env(topo, common, w))) for w in range(2)]
        children = Children()
        progress.follow(os.path.join(log_dir, "rank0.log"), f"rounds ({transport})")
        run_or_exit(children, plan, {"rank0", "rank1"}, 1800, log_dir, f"bench_hook: the {transport} run", 4000,
                    tick=progress)
        results += json.load(open(raw))
    progress.close()
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.rank_out:
        return rank_main(args)
    from bench_cluster import Loopback, Switched
    net, where = None, "loopback"
    if args.shaped:
        netns = import_netns()
        try:
            net = netns.SwitchedMachines(args.shaped, 2, congestion=args.tcp_congestion).__enter__()
            where = f"{args.shaped} shaped ({net.describe()})"
        except netns.NetnsUnavailable as e:
            sys.exit(f"bench_hook: cannot shape a link here: {e}")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-hook-") as log_dir:
            results = run_ranks(args, Switched(net) if net else Loopback(), log_dir)
    finally:
        if net is not None:
            net.delete()
    report(args, results, where)


def report(args, results, where):
    by = {r["row"]: r["median_s"] for r in results}
    floor, psgd = by.get("DDP no communication"), by.get("DDP PowerSGD rank 1")
    model = ("ResNet-50 v1b's 161 gradient shapes" if args.model == "resnet50-shapes" else
             f"MLP {args.layers} x {args.width}, batch {args.batch} per rank")
    print(f"2 ranks, {where}; {model}, DDP buckets "
          f"{args.bucket_mb:g} MB; rank 0's median of {args.rounds} steps after {args.warmup} warm-up, rows "
          "taking turns")
    width = max(len(r["row"]) for r in results)
    print(f"{'':{width}} {'step s':>8} {'min':>7} {'max':>7} {'cpu s':>7} {'in step()':>9} {'held':>6} "
          f"{'vs no comm':>10} {'vs PowerSGD r1':>14}")
    for r in results:
        r["vs_no_communication"] = r["median_s"] / floor if floor else None
        r["vs_powersgd_rank1"] = r["median_s"] / psgd if psgd else None
        held = f"{r['held']:.3f}" if r["held"] is not None else "-"
        ratios = [f"{v:.2f}x" if v else "-" for v in (r["vs_no_communication"], r["vs_powersgd_rank1"])]
        in_step = f"{r['in_step_s']:.4f}" if r["in_step_s"] is not None else "-"
        print(f"{r['row']:{width}} {r['median_s']:8.4f} {r['min_s']:7.4f} {r['max_s']:7.4f} {r['cpu_s']:7.4f} "
              f"{in_step:>9} {held:>6} {ratios[0]:>10} {ratios[1]:>14}")
    targets = []
    row, alone = by.get(f"bps_gc hook {TARGET}"), by.get(f"{TARGET} reduction alone")
    held = next((r["held"] for r in results if r["row"] == f"bps_gc hook {TARGET}"), None)
    if held is not None:
        targets.append((f"held fraction, bps_gc hook {TARGET}", held, 0.2))
    if row and floor and alone:
        targets.append((f"step / max(no communication, reduction alone), {TARGET}", row / max(floor, alone), 1.15))
    if row and psgd:
        targets.append((f"step / PowerSGD rank 1's, {TARGET}", row / psgd, 1.0))
    for what, value, bound in targets:
        print(f"target: {what} = {value:.3f} (<= {bound:g}: {'met' if value <= bound else 'NOT met'})")
    for r in results:
        if r.get("timeline"):
            print_timeline(r["row"], r["timeline"])
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json_atomic(args.json, {"link": where, "command": sys.argv, "model": {
        "name": args.model, "width": args.width, "layers": args.layers, "batch": args.batch, "bucket_mb": args.bucket_mb},
        "warmup": args.warmup, "rounds": args.rounds, "rows": results,
        "targets": [{"what": w, "value": v, "at_most": b} for w, v, b in targets]})
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
