"""bench_pushpull: the worker processes (bps_gc through bpslaunch, ps-lite the MXNet way) and a
profiled scheduler/server node; the driver starts them as `bench_pushpull.py _bps-worker ...`."""
import argparse
import os
import sys
import threading
import time

import numpy as np

from bench_common import BPS_CONFIGS, MODEL, PSLITE_CONFIGS, ThreadProfiler, cpu_counters, cpu_delta, link_counters, link_delta, load_shapes, make_grad, nic_bytes, write_json_atomic


def bps_worker(argv):
    parser = argparse.ArgumentParser(prog="bench_pushpull.py _bps-worker")
    parser.add_argument("--config", required=True, choices=list(BPS_CONFIGS))
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--tensors", type=int, default=0, help="only the first N tensors (0: all)")
    parser.add_argument("--elements", type=int, default=0, help="one tensor of N floats instead")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    profiler = ThreadProfiler() if args.profile and os.environ.get("DMLC_WORKER_ID") == "0" else None

    import bps_gc.core as bps
    shapes = load_shapes(args.tensors, args.elements)
    compression = BPS_CONFIGS[args.config]
    t_start = time.perf_counter()
    bps.init()
    rank, size = bps.rank(), bps.size()
    grads = [make_grad(s, rank, i) for i, s in enumerate(shapes)]
    outs = [np.empty_like(g) for g in grads]
    names = [f"{MODEL}.{i}" for i in range(len(shapes))]
    for name, shape in zip(names, shapes):
        bps.declare(name, shape=shape, dtype=np.float32, **compression)
    t_ready = time.perf_counter()

    def one_round():
        t0 = time.perf_counter()
        handles = [bps.push_pull(g, name, average=True, priority=-i, lr=0.1, out=o)
                   for i, (g, name, o) in enumerate(zip(grads, names, outs))]
        t1 = time.perf_counter()
        for h in handles:
            h.wait()
        return time.perf_counter() - t0, t1 - t0

    trace = NicTrace() if os.environ.get("BENCH_TRACE") else None
    bps.barrier()
    for _ in range(args.warmup):
        one_round()
    bps.metrics()  # reset the counters
    bps.barrier()
    before, cpu_before = link_counters(), cpu_counters()
    rounds = []
    for _ in range(args.rounds):
        bps.barrier()  # every worker starts the round together, as the torch rows' dist.barrier()
        if trace:
            trace.mark("start")
        seconds, issue = one_round()
        if trace:
            trace.mark("end")
        m = bps.metrics()
        rounds.append({"seconds": seconds, "issue_seconds": issue, "pushed_raw": m.pushed_raw,
                       "pushed_wire": m.pushed_wire, "pulled_raw": m.pulled_raw,
                       "pulled_wire": m.pulled_wire, "compress_seconds": m.compress_seconds,
                       "communicate_seconds": m.communicate_seconds,
                       "wait_seconds": m.wait_seconds})
    cpu = cpu_delta(cpu_before, cpu_counters(), args.rounds)
    bps.barrier()  # the other worker's last replies are in too: count the link after it
    link = link_delta(before, link_counters())
    check = None
    if not compression:  # dense: the result is exactly the average of both workers' gradients
        bad = []
        for i in (0, len(shapes) // 2, len(shapes) - 1, int(np.argmax([g.size for g in grads]))):
            expected = sum(make_grad(shapes[i], r, i) for r in range(size)) / np.float32(size)
            if not np.allclose(outs[i], expected, rtol=1e-5, atol=1e-9):
                bad.append(i)
        check = "ok" if not bad else f"MISMATCH in tensors {bad}"
    result = {"system": "bps_gc", "config": args.config, "rank": rank, "size": size,
              "setup_seconds": t_ready - t_start, "rounds": rounds, "link": link,
              "cpu": cpu, "check": check}
    bps.shutdown()
    if trace:
        path = f"{os.environ['BENCH_TRACE']}.{args.config}.w{rank}.json"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # a fresh clone has no out/trace
        write_json_atomic(path, trace.stop())
    if profiler is not None:
        result["profile"] = profiler.report()
    write_json_atomic(os.path.join(args.result_dir, f"bps-w{rank}.json"), result)


class NicTrace:
    """Samples this machine's NIC byte counters every 10 ms on a thread (BENCH_TRACE=PREFIX)."""

    def __init__(self):
        self.samples, self.marks, self.done = [], [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(0.01):
            nic = nic_bytes()
            if nic:
                self.samples.append((time.time(), *nic))

    def mark(self, what):
        self.marks.append((time.time(), what))

    def stop(self):
        self.done.set()
        self.thread.join()
        return {"samples": self.samples, "marks": self.marks}


def mx_worker(argv):
    parser = argparse.ArgumentParser(prog="bench_pushpull.py _mx-worker")
    parser.add_argument("--config", required=True, choices=list(PSLITE_CONFIGS))
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--tensors", type=int, default=0, help="only the first N tensors (0: all)")
    parser.add_argument("--elements", type=int, default=0, help="one tensor of N floats instead")
    args = parser.parse_args(argv)

    import mxnet as mx
    shapes = load_shapes(args.tensors, args.elements)
    t_start = time.perf_counter()
    kv = mx.kv.create("dist_sync")
    compression = PSLITE_CONFIGS[args.config]
    if compression:
        kv.set_gradient_compression(compression)
    rank, size = kv.rank, kv.num_workers
    keys = list(range(len(shapes)))
    grads = [mx.nd.array(make_grad(s, rank, i), dtype=np.float32) for i, s in enumerate(shapes)]
    outs = [mx.nd.zeros(s, dtype=np.float32) for s in shapes]
    kv.init(keys, [mx.nd.zeros(s, dtype=np.float32) for s in shapes])
    mx.nd.waitall()
    t_ready = time.perf_counter()

    def one_round():
        t0 = time.perf_counter()
        for i in keys:  # as Module.update does: push then pull each key, priority -index
            kv.push(i, grads[i], priority=-i)
            kv.pull(i, out=outs[i], priority=-i)
        mx.nd.waitall()
        return time.perf_counter() - t0

    kv._barrier()
    for _ in range(args.warmup):
        one_round()
    kv._barrier()
    before, cpu_before = link_counters(), cpu_counters()
    rounds = []
    for _ in range(args.rounds):
        kv._barrier()  # as bps_worker: every worker starts the round together
        rounds.append({"seconds": one_round()})
    cpu = cpu_delta(cpu_before, cpu_counters(), args.rounds)
    kv._barrier()  # the other worker's last pulls are in too: count the link after it
    link = link_delta(before, link_counters())
    check = None
    if not compression:
        # No updater on the server: a pull returns the sum of the round's pushes. KVStoreDist
        # pulls into the buffer it pushed from (comm_buf_[key] is the pushed array on CPU), so
        # each round overwrites the gradient with the sum, and every later round multiplies it
        # by the number of workers.
        bad = []
        scale = np.float32(float(size) ** (args.warmup + args.rounds - 1))
        for i in (0, len(shapes) // 2, len(shapes) - 1, int(np.argmax([np.prod(s) for s in shapes]))):
            expected = sum(make_grad(shapes[i], r, i) for r in range(size)) * scale
            # ps-lite sums in arrival order: with 3+ workers an element that nearly cancels
            # differs by a few ulps of the addends, hence the absolute tolerance scaled with them
            if not np.allclose(outs[i].asnumpy(), expected, rtol=1e-5, atol=1e-9 * float(scale) * size):
                bad.append(i)
        check = "ok" if not bad else f"MISMATCH in tensors {bad}"
    raw = sum(int(np.prod(s)) * 4 for s in shapes)
    for r in rounds:
        r["pushed_raw"] = r["pulled_raw"] = raw
    result = {"system": "ps-lite", "config": args.config, "rank": rank, "size": size,
              "setup_seconds": t_ready - t_start, "rounds": rounds, "link": link,
              "cpu": cpu, "check": check}
    write_json_atomic(os.path.join(args.result_dir, f"mx-w{rank}.json"), result)


def profiled_node(argv):
    """`python -m bps_gc.node` with every thread cProfiled; the report goes to argv[0]."""
    profiler = ThreadProfiler()
    from bps_gc import node
    try:
        status = node.main()
    finally:
        with open(argv[0], "w") as f:
            f.write(profiler.report())
    sys.exit(status)


