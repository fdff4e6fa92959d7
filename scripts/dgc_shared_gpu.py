#!/usr/bin/env python3
"""DGC's ResNet-20 (the seed's printed configs) with several ranks on one host, on both
transports: ranks sharing one GPU on a one-GPU box (issue 32), or CPU processes at tiny size
(the test). It writes a small CIFAR-10 in the official format whose classes can be learnt (each
class brightens its own band of rows), runs example/pytorch/dgc/train.py under torchrun (the
collective) and under bpslaunch with one server (the parameter server), then checks from each
rank's checkpoint that the ranks' parameters are bit-identical, and from metrics.jsonl that the
training loss fell from the first epoch to the last.

    python scripts/dgc_shared_gpu.py --device cuda --out out/gpu/dgc              # a few hundred steps
    python scripts/dgc_shared_gpu.py --device cpu --images 80 --batch 8 --epochs 2 --lr 0.02 --out /tmp/dgc

Prints one row per transport and writes OUT/dgc_shared_gpu.json; exits 1 when a check fails.
"""
import argparse
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np

from bench_common import pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "example", "pytorch", "dgc", "train.py")
SEED_CONFIGS = ["configs/cifar/resnet20.py", "configs/dgc/wm5.py", "configs/dgc/fp16.py", "configs/dgc/int32.py"]
RUN_NAME = "[cifar.resnet20+dgc.[wm5+fp16+int32]]"
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm statistics stay local


def write_cifar10(folder, n_train, n_test, seed=0):
    """data_batch_1..5 and test_batch with labels the images show: class c adds 60 to rows
    3c..3c+2 of every channel, over uniform noise."""
    rng = np.random.default_rng(seed)
    out = os.path.join(folder, "cifar-10-batches-py")
    os.makedirs(out, exist_ok=True)
    for name, n in [(f"data_batch_{i}", n_train // 5) for i in range(1, 6)] + [("test_batch", n_test)]:
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 150, (n, 3, 32, 32))
        for i, c in enumerate(labels):
            images[i, :, 3 * c:3 * c + 3, :] += 60
        data = {b"batch_label": name.encode(), b"labels": labels.tolist(),
                b"data": images.reshape(n, 3072).astype(np.uint8),
                b"filenames": [f"img{i}.png".encode() for i in range(n)]}
        with open(os.path.join(out, name), "wb") as f:
            pickle.dump(data, f, protocol=2)


def command(transport, ranks, argv):
    py = sys.executable
    if transport == "collective":
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), TRAIN, *argv]
    return [py, "-m", "bps_gc.launcher.cli", "--local", "--workers", str(ranks), "--servers", "1", "--", py, TRAIN,
            *argv]


def identical_ranks(run_dir, ranks):
    """(whether every rank's parameters equal rank 0's bit for bit, the names that differ)."""
    import torch
    states = [torch.load(os.path.join(run_dir, "checkpoints", f"latest-r{r}.pth"), map_location="cpu",
                         weights_only=True)["model"] for r in range(ranks)]
    differ = sorted({name for state in states[1:] for name, value in state.items()
                     if not name.endswith(BUFFERS) and not torch.equal(value, states[0][name])})
    return not differ, differ


def check(transport, args, work):
    folder = os.path.join(work, transport)
    os.makedirs(folder, exist_ok=True)
    write_cifar10(os.path.join(folder, "data"), args.images, max(10, args.images // 8))
    argv = ["--configs", *SEED_CONFIGS, "--device", args.device, "--configs.dataset.root", "data",
            "--configs.train.batch_size", str(args.batch), "--configs.train.num_epochs", str(args.epochs),
            "--configs.train.warmup_lr_epochs", "1", "--configs.data.num_threads_per_worker", "0"]
    if args.lr is not None:
        argv += ["--configs.train.optimizer.lr", str(args.lr)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = pythonpath(ROOT)  # no empty entry (the current folder) when the caller set none
    began = time.perf_counter()
    result = subprocess.run(command(transport, args.ranks, argv), cwd=folder, env=env, capture_output=True, text=True,
                            timeout=args.timeout)
    seconds = time.perf_counter() - began
    output = result.stdout + result.stderr
    with open(os.path.join(folder, "output.txt"), "w") as f:
        f.write(output)
    row = {"transport": transport, "ranks": args.ranks, "exit": result.returncode, "seconds": seconds}
    if result.returncode != 0:
        return dict(row, ok=False, error=output[-2000:])
    run_dir = os.path.join(folder, "runs", f"{RUN_NAME}.np{args.ranks}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        epochs = [json.loads(line) for line in f]
    same, differ = identical_ranks(run_dir, args.ranks)
    log = open(os.path.join(run_dir, "train.log")).read()
    device = next((line for line in log.splitlines() if line.startswith("device: ")), "device: ?")
    shared = next((line.split("bps_gc: ", 1)[1] for line in output.splitlines() if "share" in line and
                   "NCCL refuses" in line), "")
    first, last = epochs[0]["loss/train"], epochs[-1]["loss/train"]
    return dict(row, steps=sum(e["steps"] for e in epochs), first_loss=first, last_loss=last,
                loss_fell=last < first, identical=same, differing=differ[:5], device=device, backend_note=shared,
                ok=same and last < first)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="what train.py's --device gets (every rank)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--images", type=int, default=1280, help="training images (test images: an eighth)")
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=None,
                   help="the base learning rate (default: the configs' 0.1); the tiny CPU run takes a smaller "
                        "one, as DGC's plain momentum at 0.1 on batch 8 does not lower the loss in 10 steps")
    p.add_argument("--transports", default="collective,ps")
    p.add_argument("--timeout", type=float, default=300, help="seconds per transport")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = [check(t.strip(), args, os.path.abspath(args.out)) for t in args.transports.split(",") if t.strip()]
    for r in rows:
        if "error" in r:
            print(f"dgc {r['transport']}: FAILED (exit {r['exit']})\n{r['error']}")
        else:
            print(f"dgc {r['transport']:<10} {r['ranks']} ranks, {r['steps']} steps, {r['seconds']:.0f} s: loss "
                  f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}, ranks identical: {r['identical']}; {r['device']}"
                  + (f"; {r['backend_note']}" if r["backend_note"] else ""))
    with open(os.path.join(args.out, "dgc_shared_gpu.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
