#!/usr/bin/env python3
"""What the DDP hook's codecs hold between steps, and their time, with the shared scratch (the
hook's default: one buffer per slot and pipeline thread, the size of the largest gradient)
beside each codec keeping its own buffers (the hook before it), in the same run: 2 gloo ranks
(torchrun, started by this script), an MLP of --layers layers of --width under DDP with 1 MB buckets,
--steps SGD steps a row after --warmup, --repeats passes with the two modes alternating.

    python scripts/ddp_hook_memory.py --json out/ddp_hook_memory.json

Columns, rank 0's: ``grads`` the model's gradient bytes; ``state/g`` what
bps_gc.torch.state_dict() saves of the hook's codecs over them; ``held/g`` every array reachable
from the hook through bps_gc objects (codecs, scratch, the pipeline's gather buffers), each once;
``ms`` and ``CPU ms`` a step's wall time and the process's CPU time (every thread), the median
of the passes.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from bench_common import machine_info, pythonpath  # noqa: E402

CODECS = {"onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          "topk 1%+EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"},
          "dithering 4": {"compressor": "dithering", "k": 4},
          "thc 4-bit": {"compressor": "thc", "bits": 4},
          "PowerSGD r4": {"compressor": "powersgd", "rank": 4}}
MODES = ("own buffers", "shared scratch")


def one_row(config, mode, width, layers, steps, warmup):
    """Train a fresh DDP model with the hook of ``config`` in ``mode``: its counts (rank 0's)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bps_gc.torch as bps
    from held_bytes import array_bytes, held_bytes

    torch.manual_seed(0)
    hidden = [m for _ in range(layers - 2) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = DDP(torch.nn.Sequential(torch.nn.Linear(width // 4, width), torch.nn.ReLU(), *hidden,
                                    torch.nn.Linear(width, width // 4)), bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hook = bps.comm_hook(config, optimizer=opt)  # no named_parameters: held would count the parameters
    if mode == "own buffers":
        hook.compression.pipeline.share_scratch(None)
    model.register_comm_hook(None, hook)
    rank = dist.get_rank()

    def step(i):
        g = torch.Generator().manual_seed(1000 * rank + i)
        x = torch.randn(32, width // 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.zeros(32, width // 4)).backward()
        opt.step()

    for i in range(warmup):
        step(i)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(warmup, warmup + steps):
        step(i)
    wall, cpu = (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps
    state = hook.compression.codec_state().state_dict()  # waits for the pipeline to go idle
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"grads": grads, "state": array_bytes(state.values()), "held": held_bytes([hook.compression]),
            "ms": 1e3 * wall, "cpu_ms": 1e3 * cpu}


def rank_main(args, out):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rows = {}
    for _ in range(args.repeats):
        for name in args.codecs:
            for mode in MODES:
                rows.setdefault(f"{name} | {mode}", []).append(one_row(CODECS[name], mode, args.width, args.layers,
                                                                         args.steps, args.warmup))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def box():
    return f"{machine_info()}; load average {os.getloadavg()[0]:.2f} at the start"


def table(rows):
    lines = [f"{'codec | buffers':34} {'grads B':>10} {'state/g':>8} {'held/g':>7} {'ms':>7} {'CPU ms':>7}"]
    for label, passes in rows.items():
        first = passes[0]
        lines.append(f"{label:34} {first['grads']:>10,} {first['state'] / first['grads']:>8.3f} "
                     f"{first['held'] / first['grads']:>7.3f} {statistics.median(p['ms'] for p in passes):>7.1f} "
                     f"{statistics.median(p['cpu_ms'] for p in passes):>7.1f}")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--codecs", default=",".join(CODECS), help="comma-separated, of: " + ", ".join(CODECS).replace("%", "%%"))
    p.add_argument("--device-chains", action="store_true",
                   help="the device chains (torch operations, as CUDA buckets run) on the CPU buckets: "
                        "BPS_GC_DEVICE_CODECS=torch")
    p.add_argument("--json", default=None)
    p.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)  # set for the ranks
    args = p.parse_args()
    args.codecs = [c.strip() for c in args.codecs.split(",")]
    unknown = [c for c in args.codecs if c not in CODECS]
    if unknown:
        p.error(f"unknown codec {unknown[0]!r}; known: {', '.join(CODECS)}")
    if args.rank_out:
        return rank_main(args, args.rank_out)
    machine = box() + ("; device chains (BPS_GC_DEVICE_CODECS=torch)" if args.device_chains else "")
    print(machine)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT, os.path.join(ROOT, "tests")))
        if args.device_chains:
            env["BPS_GC_DEVICE_CODECS"] = "torch"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               os.path.abspath(__file__), *sys.argv[1:], "--rank-out", out], env=env)
        if done.returncode != 0:
            raise SystemExit(f"ddp_hook_memory: the ranks failed (exit {done.returncode})")
        rows = json.load(open(out))
    print("\n".join(table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"box": machine, "args": {k: v for k, v in vars(args).items() if k != "rank_out"}, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
