#!/usr/bin/env python3
"""What bps_gc's codec state adds to a checkpoint, per rank (docs/checkpoint.md): for each codec,
the bytes of bps_gc.torch.state_dict() saved with torch.save (next to the model's own bytes) and
the time to collect and save it (bps_gc.torch.save_checkpoint: write, fsync, rename).

    python scripts/bench_checkpoint.py [--models resnet20,resnet50] [--json out.json]

One process, a world of one rank on torch.distributed (gloo): the rank's state is what every
rank of a larger job keeps for itself (its chains; with the collective every rank also runs the
servers' reducers, so a recompress reducer's server chain is in it). Each codec trains its
model for two steps first, so every state exists. Prints a table; --json writes the rows.
"""
import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "example", "pytorch"), os.path.join(ROOT, "example")]

CODECS = {
    "dense": ("optimizer", None),
    "onebit+EF+nesterov": ("optimizer", {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"}),
    "topk 1%+EF": ("optimizer", {"compressor": "topk", "k": 0.01, "ef": "vanilla"}),
    "randomk 1%": ("optimizer", {"compressor": "randomk", "k": 0.01}),
    "dithering 4": ("optimizer", {"compressor": "dithering", "k": 4}),
    "dgc 0.1%": ("optimizer", {"compressor": "dgc", "k": 0.001, "mu": 0.9}),
    "powersgd r4": ("optimizer", {"compressor": "powersgd", "rank": 4}),
    "topk 1%+EF (hook)": ("hook", {"compressor": "topk", "k": 0.01, "ef": "vanilla"}),
    "choco topk 1%": ("choco", {"compressor": "topk", "k": 0.01}),
    "local SGD signnorm+EF": ("local_sgd", {"compressor": "signnorm", "ef": "vanilla"}),
}


def model_of(name):
    if name == "resnet50":
        from imagenet_resnet import ResNet
        return ResNet("resnet50", 1000, 64), (2, 3, 64, 64), 1000
    from train_cifar100_byteps_gc import resnet
    return resnet(name), (4, 3, 32, 32), 100


def measure(model_name, codec, kind, params, bps, torch):
    from torch.nn.parallel import DistributedDataParallel as DDP
    net, shape, classes = model_of(model_name)
    base = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.0 if kind == "optimizer" and params and
                           params.get("compressor") in ("dgc", "powersgd") else 0.9)
    model, opt = net, base
    if kind == "hook":
        model = DDP(net)
        model.register_comm_hook(None, bps.comm_hook(params, optimizer=base, named_parameters=net.named_parameters()))
    elif kind == "optimizer":
        opt = bps.DistributedOptimizer(base, named_parameters=net.named_parameters(), compression_params=params)
    elif kind == "choco":
        opt = bps.DecentralizedOptimizer(base, net.named_parameters(), "choco", topology="complete",
                                         compression_params=params, name=codec)
    else:
        opt = bps.LocalSGD(base, net.named_parameters(), local_steps=2, compression_params=params, prefix=codec)
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(torch.randn(*shape)), torch.randint(0, classes, (shape[0],))).backward()
        opt.step()
        opt.zero_grad()
    start = time.perf_counter()
    state = bps.state_dict()
    collect = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        bps.save_checkpoint({"bps_gc": state}, os.path.join(folder, "rank0.pth"))
        save = time.perf_counter() - start
    codec_bytes, model_bytes = io.BytesIO(), io.BytesIO()
    torch.save(state, codec_bytes)
    torch.save(net.state_dict(), model_bytes)
    row = {"model": model_name, "codec": codec, "parameters": sum(p.numel() for p in net.parameters()),
           "model_bytes": model_bytes.tell(), "state_bytes": codec_bytes.tell(),
           "collect_ms": 1000 * collect, "save_ms": 1000 * save}
    return row


def one(model_name, codec):
    """One row, in this process (a fresh one per row: the communicator keeps what was declared)."""
    from bps_gc.launcher.local import free_port
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), BYTEPS_MIN_COMPRESS_BYTES="0")
    import torch
    import bps_gc.torch as bps
    bps.init()
    kind, params = CODECS[codec]
    print(json.dumps(measure(model_name, codec, kind, params, bps, torch)))
    bps.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet20,resnet50")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--json", default=None)
    p.add_argument("--one", nargs=2, metavar=("MODEL", "CODEC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(*args.one)
    rows = []
    print(f"{'model':9} {'codec':24} {'params':>10} {'model MB':>9} {'state MB':>9} {'state/model':>11} "
          f"{'collect ms':>10} {'save ms':>8}")
    for model_name in args.models.split(","):
        for codec in args.codecs.split(","):
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", model_name, codec],
                                  capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if done.returncode != 0:
                raise SystemExit(f"{model_name} {codec}: {done.stderr[-2000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{row['model']:9} {codec:24} {row['parameters']:>10} {row['model_bytes'] / 1e6:>9.2f} "
                  f"{row['state_bytes'] / 1e6:>9.2f} {row['state_bytes'] / row['model_bytes']:>11.2f} "
                  f"{row['collect_ms']:>10.1f} {row['save_ms']:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
