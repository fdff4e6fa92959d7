#!/usr/bin/env python3
"""The torch.distributed side of the benchmark: PyTorch's own DDP hooks against bps_gc's
collective transport, on ResNet-50 v1b gradient shapes (161 float32 tensors, 25.56M floats),
N ranks on one host over loopback (gloo), all rows in one run of the same processes.

Rows (worker 0's median s/round over the timed rounds, after warm-up rounds; cpu_s: its median
CPU seconds per round, every thread of its process, which a loaded machine moves less than the
wall time; py_cpu_s: the same of its Python threads alone (the caller's, bps_gc's exchange and
heartbeat threads; not gloo's): the bookkeeping around the collectives):
  torch all_reduce dense   161 gradients fused into 25 MB buckets (DDP's size), one gloo
                           all_reduce each, waited for together
  torch floor, views: all_reduce dense (AVG)
                           the same all_reduces averaged by gloo (AVG: the sum, then a divide on
                           each rank): the least bps_gc collective dense views can take
  torch dense floor: copy in, sum, average out
                           the same all_reduces with the two copies a push_pull of separate
                           arrays into separate outputs needs: each gradient copied into its
                           bucket (closed at 25 MB, as bps_gc's), the average written out in one
                           pass; the least bps_gc collective dense can take
  torch floor, in place: each gradient alone (AVG)
                           161 all_reduces, one a gradient in its own memory, averaged by gloo,
                           started together: no copy, but gloo's cost per all_reduce 161 times
  torch floor, in place: large alone (AVG), the rest fused
                           bps_gc's in-place arrangement without bps_gc: gradients of 4 MB or
                           more alone in their memory (AVG), the others in bps_gc's buckets,
                           copied in and averaged back; the least bps_gc collective dense in
                           place can take
  DDP compute only         the benchmark model's forward/backward without communication: the
                           floor under every DDP row (gradient = a fixed random tensor per layer)
  DDP dense / fp16 hook / PowerSGD rank 1, 4 / bps_gc hook
                           one DDP step (forward, backward with the hook, no optimizer) of a
                           model whose parameters have the ResNet-50 shapes; torch's own hooks
                           (PowerSGD: error feedback, warm start, compression from the 3rd step
                           on, so its rows warm up at least 2 steps and time compressed ones only;
                           one 102 MB bucket: several buckets' phases interleave differently on
                           each rank under gloo and the run aborts)
  bps_gc collective ...    bps_gc.core push_pull of the 161 gradients (declared with the codec,
                           partitions and thresholds as on the parameter server) into separate
                           outputs, then wait
  bps_gc collective dense in place
                           the same, dense, each gradient averaged in place (no out=), as the
                           torch and MXNet bindings reduce theirs
  bps_gc collective dense views
                           the same in place, the gradients views back to back in one flat
                           array in push order (bps_gc.torch.flat_grads, DDP's bucket views):
                           each bucket all_reduced where it lies, averaged by one divide

    python scripts/bench_collective.py                 # 2 ranks, 3 warm-up + 5 timed rounds
    python scripts/bench_collective.py --quick         # smoke run: a few rows, 1 + 2 rounds
    python scripts/bench_collective.py --ranks 4 --json out/bench_collective_4.json
    python scripts/bench_collective.py --ranks 8 --rows "collective thc,collective onebit" \
        --warmup 1 --rounds 1 --tensors 20      # the wire column only (bytes are deterministic)

wire MB/round: the bytes one bps_gc rank hands torch.distributed per round and gets back (an
all_reduce's buffer each way; an all_gather's own payloads out, every other rank's in).

Ratios are to DDP PowerSGD rank 1 measured in the same run. JSON goes to
out/bench_collective.json unless --json says otherwise.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_common import BPS_CONFIGS, PY, ROOT, link_counters, link_delta, load_shapes, pythonpath
from bench_hook_timeline import thread_cpu

BUCKET_BYTES = 25 << 20
START_POWERSGD_ITER = 2
CODECS = {name: params for name, params in BPS_CONFIGS.items() if params}
QUICK = ("torch all_reduce dense", "DDP dense", "DDP PowerSGD rank 1", "bps_gc collective topk 0.1%")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a few rows, 1 warm-up + 2 timed rounds")
    p.add_argument("--rows", default=None, help="only rows whose label contains one of these "
                   "comma-separated words (e.g. PowerSGD,topk)")
    p.add_argument("--tensors", type=int, default=0, help="only the first N tensors (0: all)")
    p.add_argument("--elements", type=int, default=0, help="one float32 tensor of N elements "
                   "instead of ResNet-50's (a matrix: bench_common.matrix_shape)")
    p.add_argument("--json", default=None, help="default: out/bench_collective.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # set for the ranks
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- ranks

def rank_main(args):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bps_gc.core as bps
    import bps_gc.torch as bps_torch
    from bps_gc.collective import buckets
    # the in-place floor follows the package's arrangement; bench_versions.py also runs this file
    # on commits from before arrays went alone, where the floor keeps today's 4 MB
    ALONE_BYTES = getattr(buckets, "ALONE_BYTES", 4 << 20)

    torch.set_num_threads(1)
    os.environ.setdefault("BPS_GC_TRANSPORT", "collective")
    bps.init()  # the collective transport: also the default process group DDP uses
    rank = bps.rank()
    shapes = load_shapes(args.tensors, args.elements)
    rng = np.random.default_rng(rank)
    grads = [(rng.standard_normal(s) * 1e-3).astype(np.float32) for s in shapes]

    class Shaped(torch.nn.Module):
        """Parameters of the given shapes; d loss / d p = a fixed tensor per parameter."""
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])
            self.ws = [torch.from_numpy(g) for g in grads]

        def forward(self):
            return sum((p * w).sum() for p, w in zip(self.ps, self.ws))

    def timed(step, warmup):
        for _ in range(warmup):
            step()
        times, cpu, py_cpu = [], [], []
        bps.metrics()  # resets bps_gc's counters: the wire bytes below are the timed rounds'
        before = link_counters()
        for _ in range(args.rounds):
            dist.barrier()
            threads = thread_cpu()
            start, used = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - used)  # every thread of this rank: the caller's, bps_gc's, gloo's
            py_cpu.append(sum(ns - threads.get(name, 0) for name, ns in thread_cpu().items()
                              if not name.endswith("(not Python's)")) / 1e9)
        return times, cpu, py_cpu, link_delta(before, link_counters())

    def allreduce_rows(op=dist.ReduceOp.SUM):
        flat = np.concatenate([g.reshape(-1) for g in grads])
        per = BUCKET_BYTES // 4
        buckets = [torch.from_numpy(flat[i:i + per].copy()) for i in range(0, flat.size, per)]

        def step():
            for work in [dist.all_reduce(b, op=op, async_op=True) for b in buckets]:
                work.wait()
        return step

    ranks = np.float32(dist.get_world_size())

    def fused(arrays):
        """bps_gc's buckets of ``arrays`` (each closed once it holds BUCKET_BYTES), each with a
        flat buffer kept across steps."""
        buckets, bucket, size = [], [], 0
        for a in arrays:
            bucket.append(a.reshape(-1))
            size += a.nbytes
            if size >= BUCKET_BYTES:
                buckets.append(bucket)
                bucket, size = [], 0
        buckets += [bucket] if bucket else []
        return [(b, np.empty(sum(a.size for a in b), np.float32)) for b in buckets]

    def send_fused(bucket, flat):
        return dist.all_reduce(torch.from_numpy(np.concatenate(bucket, out=flat)), async_op=True)

    def average_out(flat, outs):
        offset = 0
        for o in outs:
            np.divide(flat[offset:offset + o.size], ranks, out=o.reshape(-1))
            offset += o.size

    def copied_rows():
        """The least a push_pull of the separate gradients into separate outputs can cost: each
        bucket (bps_gc's) copied into a buffer kept across steps, all_reduced, and averaged
        into the outputs in one pass."""
        buckets = fused(grads)
        outs = [[np.empty_like(g) for g in b] for b, _ in buckets]

        def step():
            works = [send_fused(b, f) for b, f in buckets]
            for work, (_, flat), out in zip(works, buckets, outs):
                work.wait()
                average_out(flat, out)
        return step

    def separate_rows():
        """Each gradient all_reduced alone in place (AVG), all started, then waited for."""
        inputs = [torch.from_numpy(g.copy()) for g in grads]

        def step():
            for work in [dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True) for t in inputs]:
                work.wait()
        return step

    def alone_rows():
        """The least a push_pull of the separate gradients in place can cost as bps_gc sends
        them: each of ALONE_BYTES or more all_reduced alone in place (AVG) as it is reached,
        the others fused (bps_gc's buckets), summed and averaged back."""
        inputs = [g.copy() for g in grads]
        large = {i for i, a in enumerate(inputs) if a.nbytes >= ALONE_BYTES}
        buckets = fused([a for i, a in enumerate(inputs) if i not in large])
        closing = {}  # the index of each bucket's last array -> the bucket
        index = [i for i in range(len(inputs)) if i not in large]
        at = 0
        for b, flat in buckets:
            at += len(b)
            closing[index[at - 1]] = (b, flat)

        def step():
            works = []
            for i, a in enumerate(inputs):
                if i in large:
                    works.append((dist.all_reduce(torch.from_numpy(a), op=dist.ReduceOp.AVG, async_op=True), None))
                elif i in closing:
                    works.append((send_fused(*closing[i]), closing[i]))
            for work, bucket in works:
                work.wait()
                if bucket is not None:
                    average_out(bucket[1], bucket[0])
        return step

    def ddp(hook=None, state=None, bucket_cap_mb=25):
        model = DDP(Shaped(), bucket_cap_mb=bucket_cap_mb)
        if hook is not None:
            model.register_comm_hook(state, hook)

        def step():
            model().backward()
            for p in model.parameters():
                p.grad = None
        return step

    def local():
        model = Shaped()

        def step():
            model().backward()
            for p in model.parameters():
                p.grad = None
        return step

    def powersgd(rank_):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_,
                                            start_powerSGD_iter=START_POWERSGD_ITER, use_error_feedback=True, warm_start=True)
        # one bucket: on gloo, the hook's chained phases of several buckets in flight get issued
        # in different orders on different ranks (a collective mismatch; pytorch issue 58467)
        return ddp(powerSGD_hook.powerSGD_hook, state, bucket_cap_mb=128)

    def collective(name, params, in_place=False):
        names = [f"{name}/{i}" for i in range(len(shapes))]
        for n, g in zip(names, grads):
            bps.declare(n, shape=g.shape, dtype=g.dtype, **params)

        if in_place:  # each round averages its own copies in place, as the bindings reduce gradients
            inputs = [g.copy() for g in grads]
            if in_place == "views":  # back to back in one flat array, in push order
                flat, ends = np.concatenate([g.reshape(-1) for g in grads]), np.cumsum([g.size for g in grads])
                inputs = [flat[end - g.size:end].reshape(g.shape) for end, g in zip(ends, grads)]
            return lambda: [h.wait() for h in [bps.push_pull(g, n, priority=-i, lr=0.1)
                                               for i, (n, g) in enumerate(zip(names, inputs))]]
        outs = [np.empty_like(g) for g in grads]  # as the parameter server's rows (bench_workers.py)

        def step():
            handles = [bps.push_pull(g, n, priority=-i, lr=0.1, out=o) for i, (n, g, o) in enumerate(zip(names, grads, outs))]
            for h in handles:
                h.wait()
        return step

    rows = {
        "torch all_reduce dense": allreduce_rows,
        "torch floor, views: all_reduce dense (AVG)": lambda: allreduce_rows(dist.ReduceOp.AVG),
        "torch dense floor: copy in, sum, average out": copied_rows,
        "torch floor, in place: each gradient alone (AVG)": separate_rows,
        "torch floor, in place: large alone (AVG), the rest fused": alone_rows,
        "DDP compute only": local,
        "DDP dense": lambda: ddp(),
        "DDP fp16 hook": lambda: ddp(default_hooks.fp16_compress_hook),
        "DDP PowerSGD rank 1": lambda: powersgd(1),
        "DDP PowerSGD rank 4": lambda: powersgd(4),
        **{f"DDP bps_gc hook {c}": (lambda c=c: ddp(bps_torch.comm_hook(CODECS[c]))) for c in ("topk 0.1%", "randomk 0.1%")},
        "bps_gc collective dense": lambda: collective("dense", {}),
        "bps_gc collective dense in place": lambda: collective("dense-in-place", {}, in_place=True),
        "bps_gc collective dense views": lambda: collective("dense-views", {}, in_place="views"),
        **{f"bps_gc collective {c}": (lambda c=c: collective(c, CODECS[c])) for c in CODECS},
    }
    results = []
    for label, build in select_rows(rows, args).items():
        # torch's PowerSGD all-reduces dense until start_powerSGD_iter: time compressed steps only
        warmup = max(args.warmup, START_POWERSGD_ITER) if "PowerSGD" in label else args.warmup
        times, cpu, py_cpu, link = timed(build(), warmup)
        counted = bps.metrics()
        # bytes this rank handed to torch.distributed and got back per round (bps_gc rows only):
        # an all_reduce's buffer each way, an all_gather's own payloads out and the others' in
        wire = (counted.pushed_wire + counted.pulled_wire) / len(times)
        results.append({"row": label, "median_s": statistics.median(times), "min_s": min(times),
                        "cpu_s": statistics.median(cpu), "cpus": cpu,
                        "py_cpu_s": statistics.median(py_cpu), "py_cpus": py_cpu,
                        "wire_per_round": wire if label.startswith("bps_gc collective") else None,
                        "max_s": max(times), "rounds": len(times), "times": times,
                        "tcp_per_round": link and {k: v / len(times) for k, v in link["tcp"].items()},
                        "nic_tx_per_round": link and link["tx_bytes"] / len(times),
                        "nic_rx_per_round": link and link["rx_bytes"] / len(times)})
        if rank == 0:
            print(f"ROW {json.dumps(results[-1])}", flush=True)
    if rank == 0:
        json.dump(results, open(args.worker, "w"))
    bps.shutdown()


def select_rows(rows, args):
    """--quick's rows, then only those whose label has one of --rows' words."""
    picked = {k: v for k, v in rows.items() if not args.quick or k in QUICK}
    if args.rows:
        words = args.rows.split(",")
        picked = {k: v for k, v in picked.items() if any(w in k for w in words)}
    return picked


def rank_plan(topo, machines, raw, args, local_ranks=1):
    """``local_ranks`` ranks on each of ``machines`` machines of ``topo`` (bench_cluster's
    Loopback or Switched), started with the variables torchrun gives them (RANK, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK = the machine), rank 0 hosting the rendezvous; gloo bound to
    each machine's NIC."""
    from bench_cluster import child_env
    port = topo.port()
    cmd = [PY, os.path.abspath(__file__), "--worker", raw, "--warmup", str(args.warmup),
           "--rounds", str(args.rounds), "--tensors", str(args.tensors),
           "--elements", str(getattr(args, "elements", 0))]
    if args.rows:
        cmd += ["--rows", args.rows]
    plan, ranks = [], machines * local_ranks
    for r in range(ranks):
        m = r // local_ranks
        env = child_env({"RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r % local_ranks),
                         "LOCAL_WORLD_SIZE": str(local_ranks), "GROUP_RANK": str(m),
                         "MASTER_ADDR": topo.host(0), "MASTER_PORT": str(port),
                         "GLOO_SOCKET_IFNAME": topo.veth(m) or "lo", "OMP_NUM_THREADS": "1",
                         "BENCH_VETH": topo.veth(m) or "",
                         "BPS_GC_TRANSPORT": "collective"})
        plan.append((f"rank{r}", topo.wrap(m, cmd), env))
    return plan, {f"rank{r}" for r in range(ranks)}


# ---------------------------------------------------------------------------- driver

def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.warmup, args.rounds = 1, 2
    if args.worker:
        return rank_main(args)
    out = args.json or os.path.join(ROOT, "out", "bench_collective.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    raw = out + ".ranks"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
            os.path.abspath(__file__), "--worker", raw, "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--tensors", str(args.tensors), "--elements", str(args.elements)]
    if args.quick:
        argv.append("--quick")
    if args.rows:
        argv += ["--rows", args.rows]
    env = dict(os.environ, PYTHONPATH=pythonpath(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, env=env, cwd=ROOT, timeout=1800, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_collective: the ranks failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    results = json.load(open(raw))
    os.remove(raw)
    reference = next((r["median_s"] for r in results if r["row"] == "DDP PowerSGD rank 1"), None)
    print(f"{args.ranks} ranks, loopback (gloo), ResNet-50 v1b gradients; worker 0's median of "
          f"{args.rounds} rounds after {args.warmup} warm-up")
    print(f"{'':34} {'s/round':>8} {'min':>7} {'max':>7} {'vs PowerSGD r1':>15} {'wire MB/round':>14} "
          f"{'CPU ms':>7} {'py CPU ms':>9}")
    for r in results:
        ratio = f"{r['median_s'] / reference:.2f}x" if reference else "-"
        r["vs_powersgd_rank1"] = r["median_s"] / reference if reference else None
        wire = f"{r['wire_per_round'] / 1e6:.3f}" if r.get("wire_per_round") is not None else "-"
        print(f"{r['row']:34} {r['median_s']:8.3f} {r['min_s']:7.3f} {r['max_s']:7.3f} {ratio:>15} {wire:>14} "
              f"{r['cpu_s'] * 1e3:7.2f} {r['py_cpu_s'] * 1e3:9.3f}")
    json.dump({"ranks": args.ranks, "transport": "loopback", "warmup": args.warmup, "rounds": args.rounds,
               "rows": results}, open(out, "w"), indent=1)
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
