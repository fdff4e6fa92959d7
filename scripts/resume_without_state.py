#!/usr/bin/env python3
"""What resuming WITHOUT bps_gc's codec state does to training (docs/checkpoint.md), in
scripts/time_to_accuracy.py's MNIST setup (MLP 784-128-10, 4,000 real digits, 1,000 held out,
batch 32 per rank, SGD lr 0.1, 2 ranks on torch.distributed): DistributedOptimizer with
topk 1% + EF + nesterov (the time-to-accuracy recipe) and with DGC 1% (momentum 0.9), trained
--epochs epochs, restarted after --restart-epoch:

* "with codec state": the restart loads everything (bit for bit the run never restarted,
  tests/test_restart_state.py), so this is also the uninterrupted run;
* "without codec state": the model and the SGD state are restored, bps_gc's state is not: error
  feedback's residuals, the momentum that moved into the codec chain, DGC's memory and the step
  counter start again from zero, as a script that saves only model and optimizer did before.

    python scripts/resume_without_state.py [--epochs 4] [--restart-epoch 2] [--json out.json]

Prints, per codec and arm: the mean training loss over the 20 steps before and after the
restart, and the held-out accuracy after every epoch. The restart is made in-process (the
state the fresh processes of a real restart would have: the codec state as constructed), so
one torchrun per codec and arm suffices.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODECS = {"topk 1% + EF + nesterov": ({"compressor": "topk", "k": 0.01, "ef": "vanilla", "momentum": "nesterov"}, 0.9),
          "dgc 1%": ({"compressor": "dgc", "k": 0.01, "mu": 0.9}, 0.0)}
WINDOW = 20


def rank_main(codec, arm, epochs, restart_epoch, out):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "example", "demo")]
    import numpy as np
    import torch
    import bps_gc.torch as bps
    from mnist_worker import accuracy, load_data, network
    bps.init()
    rank, size = bps.rank(), bps.size()
    x, y, xv, yv = load_data(4000)
    model = network(128, 0)
    params, momentum = CODECS[codec]
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                   named_parameters=model.named_parameters(), compression_params=params)
    fresh = bps.state_dict()  # what new processes start from when nothing of bps_gc's is loaded
    shard = np.arange(rank, len(x), size)
    losses, accuracies = [], []
    for epoch in range(epochs):
        if epoch == restart_epoch and arm == "without codec state":
            bps.load_state_dict(fresh)
        opt.set_epoch(epoch)
        order = np.random.default_rng(epoch).permutation(shard)
        for start in range(0, len(order) - 31, 32):
            batch = order[start:start + 32]
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(bps.push_pull(loss.detach().reshape(1), name="loss").item()))
        accuracies.append(accuracy(model, xv, yv))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "accuracies": accuracies, "steps_per_epoch": len(losses) // epochs}, f)
    bps.barrier()
    bps.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--restart-epoch", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--rank", nargs=3, help=argparse.SUPPRESS)  # codec, arm, out: one rank of a run
    args = p.parse_args()
    if args.rank:
        return rank_main(args.rank[0], args.rank[1], args.epochs, args.restart_epoch, args.rank[2])
    import tempfile
    rows = []
    print(f"{'codec':24} {'arm':20} {'loss before':>11} {'loss after':>10}  accuracy after each epoch")
    with tempfile.TemporaryDirectory() as folder:
        for codec in CODECS:
            for arm in ("with codec state", "without codec state"):
                out = os.path.join(folder, "run.json")
                argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.abspath(__file__), "--epochs", str(args.epochs), "--restart-epoch",
                        str(args.restart_epoch), "--rank", codec, arm, out]
                done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                if done.returncode != 0:
                    raise SystemExit(f"{codec} {arm}: {done.stderr[-3000:]}")
                run = json.load(open(out))
                at = run["steps_per_epoch"] * args.restart_epoch
                before = sum(run["losses"][at - WINDOW:at]) / WINDOW
                after = sum(run["losses"][at:at + WINDOW]) / WINDOW
                rows.append({"codec": codec, "arm": arm, "loss_before": before, "loss_after": after, **run})
                print(f"{codec:24} {arm:20} {before:>11.4f} {after:>10.4f}  "
                      f"{' '.join(f'{a:.4f}' for a in run['accuracies'])}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "restart_epoch": args.restart_epoch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
