#!/usr/bin/env python3
"""Train a ResNet on CIFAR-100 with bps_gc.torch and gradient compression.

The PyTorch twin of example/mxnet/train_cifar100_byteps_gc.py (BytePS's gluon CIFAR-100
script): the same flags where they apply, the same log lines.

    bpslaunch --local --workers 2 --servers 1 -- \\
        python example/pytorch/train_cifar100_byteps_gc.py --data-dir ~/data/cifar100 \\
        --compressor onebit --onebit-scaling --ef vanilla --compress-momentum nesterov

Data: the official CIFAR-100 python version, DATA_DIR/cifar-100-python/{train,test} (pickled
dicts with b'data', uint8 N x 3072, and b'fine_labels'; the 100 fine labels are used). These
local files are trusted input; nothing received over the network is unpickled. Augmentation
(4-pixel zero padding + random 32x32 crop, horizontal flip) and normalization are numpy, on
-j threads. Each epoch every worker takes its own equal share of a shuffled training set;
the last partial batch is dropped, so all workers run the same number of steps.

Log lines (stdout and <log-dir>/cifar100-<workers>-cpu-<logging-file>.log, --log-dir out/ under
the working directory unless given; rank 0 only):
    [Epoch N] speed: X samples/sec<TAB>time cost: Y     (X: all workers together)
    [Epoch N] training: accuracy=A                      (over all workers)
    [Epoch N] validation: accuracy=A                    (test set sharded over workers,
                                                         correct and count summed by push_pull)
"""
import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import bps_gc.core
import bps_gc.torch as bps
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compression_flags import add_compression_args, compression_params  # noqa: E402
from cifar100_data import CLASSES, augment, epoch_batches, load_split, normalize, prefetch  # noqa: E402
from torch_device import add_device_arg, from_num_gpus, on_device, pick_device, pinned  # noqa: E402
from training_utils import decay_epochs, log_traffic, make_logger, steps_per_epoch  # noqa: E402

DEPTHS = (20, 32, 44, 56, 110)


def build_parser():
    parser = argparse.ArgumentParser(description="Train a model for CIFAR-100 image classification with bps_gc.")
    parser.add_argument("--data-dir", type=str, default="~/.mxnet/datasets/cifar100",
                        help="directory holding cifar-100-python/{train,test}")
    parser.add_argument("--batch-size", type=int, default=32, help="training batch size per worker")
    parser.add_argument("--model", type=str, default="resnet20",
                        help="resnet20, resnet32, resnet44, resnet56 or resnet110 (CIFAR ResNet v1; "
                             "gluon names like cifar_resnet20_v1 work too)")
    parser.add_argument("-j", "--num-data-workers", dest="num_workers", default=2, type=int,
                        help="threads preparing batches (0: in the training loop)")
    parser.add_argument("--num-epochs", type=int, default=200, help="number of training epochs")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--wd", type=float, default=0.0005, help="weight decay")
    parser.add_argument("--lr-decay", type=float, default=0.1, help="learning rate decay factor")
    parser.add_argument("--lr-decay-period", type=int, default=0,
                        help="decay every this many epochs (0: use --lr-decay-epoch)")
    parser.add_argument("--lr-decay-epoch", type=str, default="100,150",
                        help="epochs at which the learning rate decays, comma-separated")
    parser.add_argument("--warmup-lr", type=float, default=0.0, help="learning rate at the start of warm-up")
    parser.add_argument("--warmup-epochs", type=int, default=0, help="epochs of linear warm-up")
    parser.add_argument("--save-period", type=int, default=10, help="save the model every this many epochs (0: never)")
    parser.add_argument("--save-dir", type=str, default="params", help="directory of saved models")
    parser.add_argument("--resume-from", type=str, help="model parameters to start from")
    parser.add_argument("--resume-epoch", type=int, default=0, help="epoch to resume from")
    parser.add_argument("--resume-state", type=str,
                        help="a rank's whole state to resume from ({rank} in the path: each rank's own), as saved "
                             "every --save-period epochs: model, optimizer, bps_gc's codec state; sets --resume-epoch")
    parser.add_argument("--logging-file", type=str, default="baseline", help="name part of the log file")
    parser.add_argument("--log-dir", type=str, default="out", help="directory of the log file (made if missing)")
    parser.add_argument("--max-iters", type=int, default=0, help="at most this many steps per epoch (0: all)")
    add_device_arg(parser)
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="BytePS's flag: 0 trains on the CPU, 1 on GPU local_rank (one GPU per worker "
                             "process); unset: --device")
    add_compression_args(parser)
    return parser


# ---------------------------------------------------------------------------------------- model

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class CifarResNet(nn.Module):
    """ResNet for 32x32 inputs (He et al. 2016, section 4.2): 6n+2 layers, 16/32/64 channels."""

    def __init__(self, depth=20, classes=CLASSES):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2, got {depth}")
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(n):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.layers(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet(name, classes=CLASSES):
    """resnet20 ... resnet110, also as gluon's cifar_resnet20_v1."""
    base = name.lower()
    if base.startswith("cifar_"):
        base = base[len("cifar_"):]
    if base.endswith("_v1"):
        base = base[:-len("_v1")]
    depth = base[len("resnet"):] if base.startswith("resnet") else ""
    if not depth.isdigit() or int(depth) not in DEPTHS:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(f'resnet{d}' for d in DEPTHS)}")
    return CifarResNet(int(depth), classes)


# ------------------------------------------------------------------------------------- training

def learning_rate(args, epoch, decays):
    """The rate at fractional epoch `epoch`: linear warm-up, then step decay."""
    if args.warmup_epochs > 0 and epoch < args.warmup_epochs:
        return args.warmup_lr + (args.lr - args.warmup_lr) * epoch / args.warmup_epochs
    if args.lr_decay_period > 0:
        steps = int(epoch // args.lr_decay_period)
    else:
        steps = sum(1 for e in decays if epoch >= e)
    return args.lr * args.lr_decay ** steps


def summed(values, name):
    """The element-wise sum of `values` over all workers."""
    t = torch.tensor(values, dtype=torch.float64)
    return bps.push_pull(t, average=False, name=name).tolist()


def evaluate(model, images, labels, batch_size, device=torch.device("cpu")):
    """(correct, count) of the model on these images."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            x, y = next(on_device([(torch.from_numpy(normalize(images[start:start + batch_size])),
                                    torch.from_numpy(labels[start:start + batch_size]))], device))
            correct += int((model(x).argmax(1) == y).sum())
    return correct, len(images)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    decays = decay_epochs(args)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    comp_params = compression_params(args, parser)
    # the data first: a missing data set should fail before the cluster waits on us
    train_x, train_y = load_split(args.data_dir, "train")
    test_x, test_y = load_split(args.data_dir, "test")

    requested, gpus_note = from_num_gpus(args.num_gpus, args.device)
    device, device_lines = pick_device(requested)
    bps.init()
    rank, size = bps.rank(), bps.size()
    kind = "gpu" if device.type == "cuda" else "cpu"
    logger = make_logger("cifar100", os.path.join(args.log_dir, f"cifar100-{size}-{kind}-{args.logging_file}.log"),
                         rank)
    logger.info(args)
    for line in ([f"note: {gpus_note}"] if gpus_note else []) + device_lines:
        logger.info(line)

    torch.manual_seed(args.seed)
    model = resnet(args.model)
    if args.resume_from:
        model.load_state_dict(torch.load(args.resume_from, map_location="cpu", weights_only=True))
    model.to(device)
    # BytePS's choice: plain momentum SGD when compressing (--compress-momentum moves the momentum
    # into the codec chain), NAG otherwise
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd,
                                nesterov=not args.compressor and args.momentum > 0)
    optimizer = bps.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression_params=comp_params)  # --fp16-pushpull: {"fp16": True}, as Compression.fp16 would
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    if args.resume_state:  # after the broadcast: each rank its own state (error feedback differs per rank)
        state = bps.load_checkpoint(args.resume_state.format(rank=rank))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # bps_gc's codec state rides in it
        args.resume_epoch = state["epoch"] + 1
        logger.info("resumed from %s at epoch %d", args.resume_state.format(rank=rank), args.resume_epoch)

    steps = steps_per_epoch(len(train_x) // size, len(train_x), size, args.batch_size, args.max_iters)
    val_x, val_y = test_x[rank::size], test_y[rank::size]

    def batch(item):
        epoch, i, indices = item
        rng = np.random.default_rng([args.seed, rank, epoch, i])
        x = normalize(augment(train_x[indices], rng))
        return pinned((torch.from_numpy(x), torch.from_numpy(train_y[indices])), device)

    executor = ThreadPoolExecutor(args.num_workers) if args.num_workers > 0 else None
    bps_gc.core.metrics()  # reset: traffic is reported per epoch
    try:
        for epoch in range(args.resume_epoch, args.num_epochs):
            tic = time.time()
            items = epoch_batches(args.seed, epoch, len(train_x), rank, size, steps, args.batch_size)
            model.train()
            correct = seen = 0
            for i, (x, y) in enumerate(on_device(prefetch(executor, batch, items, max(1, args.num_workers)), device)):
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(args, epoch + i / steps, decays)
                optimizer.zero_grad()
                out = model(x)
                loss = F.cross_entropy(out, y)
                loss.backward()
                optimizer.step()
                correct += int((out.argmax(1) == y).sum())
                seen += len(y)
            elapsed = time.time() - tic
            train_correct, train_seen = summed([correct, seen], "metric.train")
            logger.info("[Epoch %d] speed: %d samples/sec\ttime cost: %f", epoch, int(train_seen / elapsed), elapsed)
            logger.info("[Epoch %d] training: accuracy=%f", epoch, train_correct / train_seen)
            val_correct, val_seen = summed(list(evaluate(model, val_x, val_y, 2 * args.batch_size, device)),
                                           "metric.val")
            logger.info("[Epoch %d] validation: accuracy=%f", epoch, val_correct / val_seen)
            log_traffic(logger, epoch)
            if args.save_period and (epoch + 1) % args.save_period == 0:
                save(model, args, epoch, rank, optimizer)
        if args.save_period and args.num_epochs > args.resume_epoch:
            save(model, args, args.num_epochs - 1, rank, optimizer)
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)
    bps.shutdown()


def save(model, args, epoch, rank, optimizer):
    """Rank 0: the model's parameters (``.params``); every rank: its whole state (``.r<rank>.state``:
    model, optimizer with bps_gc's codec state, epoch) for --resume-state. Both atomically."""
    os.makedirs(args.save_dir, exist_ok=True)
    base = os.path.join(args.save_dir, f"cifar100-{args.model}-{epoch}")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}  # every rank calls
    if rank == 0:
        bps.save_checkpoint(state["model"], base + ".params")
    bps.save_checkpoint(state, f"{base}.r{rank}.state")


if __name__ == "__main__":
    main()
