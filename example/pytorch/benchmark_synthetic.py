#!/usr/bin/env python3
"""Training throughput on synthetic data, with bps_gc.torch: in the form of Horovod's
pytorch_synthetic_benchmark.py and BytePS's benchmark_byteps.py.

Started without a launcher it is the suite (issue 32): it launches --ranks ranks itself, under
torchrun for DDP's allreduce, fp16 and PowerSGD (rank 1, 4) hooks and bps_gc's comm hook
(onebit+EF, topk 1%+EF, DGC 0.1%), then under bpslaunch for DistributedOptimizer on the parameter
server (topk 1%+EF), all on the same devices, and prints one table: images/sec per GPU (per
process on the CPU), ms per step, and each row's codec time per step (compress and decode of
every bucket on the device's own timer: benchmark_rows.py), also against the step of the row
without communication; --json writes it.

    python example/pytorch/benchmark_synthetic.py --model resnet50 --batch-size 64 --device cuda
    python example/pytorch/benchmark_synthetic.py --model mlp --ranks 2 --num-iters 5 --json out/bench.json

Started under a launcher it runs dense and the compressors through DistributedOptimizer on the
transport the launcher chose:

    bpslaunch --local --workers 2 --servers 1 -- python example/pytorch/benchmark_synthetic.py
    bpslaunch --local --workers 2 --servers 1 -- python example/pytorch/benchmark_synthetic.py \\
        --model mlp --compressor topk --k 0.01 --ef vanilla

Each configuration trains a fresh model (CIFAR ResNet or an MLP on 3x32x32 inputs, SGD with
momentum) on one fixed random batch: --num-warmup steps, then --num-iters timed steps. Rank 0
prints a table: images/sec per worker (the mean over workers), milliseconds per step, bytes
each worker pushed per step (on the wire and uncompressed) and their ratio. Without
--compressor the configurations are dense and the five of launch/run.sh's job names
(onebit, topk, randomk, dithering: same flags); with --compressor, dense and that one, set by
--k/--ef/--compress-momentum/--onebit-scaling. --fp16-pushpull applies to all of them.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compression_flags import add_compression_args, compression_params  # noqa: E402
from resnet_layouts import LAYOUTS  # noqa: E402
from torch_device import add_device_arg, pick_device  # noqa: E402

# torch, bps_gc.torch and the models are imported where they are used, by the ranks: the suite's
# driver (started without a launcher) only launches them and reads their results (~1.5 s of CPU less)

# what launch/run.sh's job names select
PRESETS = {
    "dense": None,
    "onebit": {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"},
    "topk": {"compressor": "topk", "k": 0.001, "ef": "vanilla"},
    "randomk": {"compressor": "randomk", "k": 0.001, "ef": "vanilla"},
    "dithering": {"compressor": "dithering", "k": 2},
}


def build_parser():
    parser = argparse.ArgumentParser(description="Synthetic-data training throughput, dense vs compressed.")
    parser.add_argument("--model", default="resnet20",
                        help=f"resnet20 ... resnet110 (CIFAR), {', '.join(LAYOUTS)} (ImageNet), or mlp")
    parser.add_argument("--image-size", type=int, default=None,
                        help="input height and width (default 224 for the ImageNet ResNets, else 32)")
    parser.add_argument("--hidden", type=int, default=1024, help="mlp: width of its two hidden layers")
    parser.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    parser.add_argument("--num-iters", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--num-warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--configs", default=",".join(PRESETS),
                        help=f"comma-separated presets to run (without --compressor): {', '.join(PRESETS)}")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--json", help="also write the results here (rank 0)")
    add_device_arg(parser)
    suite = parser.add_argument_group("the suite (started without a launcher)")
    suite.add_argument("--ranks", type=int, default=1, help="ranks on this host (several may share a GPU)")
    suite.add_argument("--rows", default=None, help="comma-separated rows to run (default: all)")
    suite.add_argument("--codec-repeats", type=int, default=5, help="timed repeats of each row's codec work")
    suite.add_argument("--timeout", type=float, default=600, help="seconds each launch may take")
    suite.add_argument("--suite-rows", default=None, help=argparse.SUPPRESS)  # the driver to its ranks
    suite.add_argument("--suite-out", default=None, help=argparse.SUPPRESS)
    add_compression_args(parser)  # --compressor: dense and that one, set by the other flags
    return parser


def configurations(args, parser):
    if args.compressor:
        params = compression_params(args, parser)
        params.pop("fp16", None)  # applies to every configuration (Compression.fp16)
        return [("dense", None), (args.compressor, params)]
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        parser.error(f"--configs: unknown {', '.join(unknown) or 'empty list'}; allowed: {', '.join(PRESETS)}")
    return [(n, PRESETS[n]) for n in names]


def describe(params):
    if not params:
        return "-"
    words = [params["compressor"]]
    words += [f"{key}={params[key]:g}" if key == "k" else f"{key}={params[key]}"
              for key in ("k", "ef", "momentum") if key in params]
    if params.get("scaling"):
        words.append("scaling")
    return " ".join(words)


def image_size(args):
    return args.image_size or (224 if args.model in LAYOUTS else 32)


def model_for(args):
    import torch.nn as nn
    from imagenet_resnet import ResNet
    from train_cifar100_byteps_gc import resnet
    if args.model == "mlp":
        size = image_size(args)
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * size * size, args.hidden), nn.ReLU(),
                             nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 100))
    if args.model in LAYOUTS:
        return ResNet(args.model, 1000)
    return resnet(args.model)


def run(args, name, params, x, y):
    """Per-worker (images/sec, seconds/step, bytes pushed/step on the wire, uncompressed)."""
    import torch
    import torch.nn.functional as F

    import bps_gc.core
    import bps_gc.torch as bps
    torch.manual_seed(0)
    model = model_for(args).to(x.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=1e-4)
    # names unique per configuration: every declared tensor keeps its compression for good
    optimizer = bps.DistributedOptimizer(
        optimizer, named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
        compression=bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none,
        compression_params=params)
    bps.broadcast_parameters([(f"{name}.{n}", p) for n, p in model.named_parameters()], root_rank=0)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(args.num_warmup):
        step()
    bps.barrier()
    bps_gc.core.metrics()  # reset
    tic = time.perf_counter()
    for _ in range(args.num_iters):
        step()
    seconds = time.perf_counter() - tic
    m = bps_gc.core.metrics()
    return args.batch_size * args.num_iters / seconds, seconds / args.num_iters, \
        m.pushed_wire / args.num_iters, m.pushed_raw / args.num_iters


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.batch_size, args.num_iters) < 1 or args.num_warmup < 0:
        parser.error("--batch-size and --num-iters must be >= 1, --num-warmup >= 0")
    if not (os.environ.get("DMLC_NUM_WORKER") or os.environ.get("WORLD_SIZE")):
        from benchmark_suite import drive
        return drive(args, parser)
    configs = None if args.suite_rows else configurations(args, parser)
    import torch

    import bps_gc.torch as bps
    device, device_lines = pick_device(args.device)
    bps.init()
    rank, size = bps.rank(), bps.size()
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch_size, 3, image_size(args), image_size(args), generator=g).to(device)
    y = torch.randint(0, 1000 if args.model in LAYOUTS else 100, (args.batch_size,), generator=g).to(device)
    if args.suite_rows:
        from benchmark_suite import rank_main
        return rank_main(args, lambda: model_for(args), device, device_lines, x, y)
    if rank == 0:  # a note only where CUDA was asked for and is missing; the device is in the header
        for line in device_lines[:-1]:
            print(line, flush=True)

    results = []
    for name, params in configs:
        speed, step_s, wire, raw = run(args, name, params, x, y)
        # the mean over workers of what each measured
        speed, step_s, wire, raw = bps.push_pull(torch.tensor([speed, step_s, wire, raw], dtype=torch.float64),
                                                 average=True, name=f"bench.{name}").tolist()
        results.append({"config": name, "compression": describe(params), "images_per_sec_per_worker": speed,
                        "ms_per_step": 1e3 * step_s, "pushed_mb_per_step": wire / 1e6,
                        "uncompressed_mb_per_step": raw / 1e6, "ratio": raw / wire if wire else None})

    if rank == 0:
        n_params = sum(p.numel() for p in model_for(args).parameters())
        print(f"model {args.model} ({n_params / 1e6:.2f} M parameters), batch {args.batch_size} per worker, "
              f"{size} workers, {args.num_iters} steps after {args.num_warmup} warm-up, {device_lines[-1]}"
              + (", fp16 push_pull" if args.fp16_pushpull else ""))
        header = f"{'config':<10} {'compression':<44} {'img/s/worker':>12} {'ms/step':>9} {'pushed MB/step':>14} {'ratio':>6}"
        print(header)
        print("-" * len(header))
        for r in results:
            ratio = f"{r['ratio']:.1f}" if r["ratio"] else "-"
            print(f"{r['config']:<10} {r['compression']:<44} {r['images_per_sec_per_worker']:>12.1f} "
                  f"{r['ms_per_step']:>9.1f} {r['pushed_mb_per_step']:>14.3f} {ratio:>6}")
        sys.stdout.flush()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "batch_size": args.batch_size, "workers": size,
                           "num_iters": args.num_iters, "fp16_pushpull": args.fp16_pushpull,
                           "results": results}, f, indent=2)
    bps.shutdown()


if __name__ == "__main__":
    main()
