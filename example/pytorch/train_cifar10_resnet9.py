#!/usr/bin/env python3
"""Train ResNet-9 (the DAWNBench net of Myrtle's "How to train your ResNet") or a CIFAR-sized
AlexNet on CIFAR-10 with the compression flags of the layer-wise vs entire-model study
(Dutta et al., AAAI 2020) and of DGC; see study_flags.py for what each flag means here.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        example/pytorch/train_cifar10_resnet9.py --data-dir ~/data --compress entiremodel \\
        --method Topk --ratio 0.01
    bpslaunch --local --workers 2 --servers 1 -- python example/pytorch/train_cifar10_resnet9.py \\
        --data-dir ~/data --compressor dgc --k 0.001 --warmup-epochs 5 --fp16-values --momentum 0.9

Under torchrun the gradients go through the torch.distributed transport, under bpslaunch
through the parameter server. Data: the official CIFAR-10 python version, DATA_DIR/
cifar-10-batches-py/{data_batch_1..5,test_batch} (cifar10_data.py); augmentation as the blog:
4-pixel padded random crop and horizontal flip. The learning rate rises linearly from 0 to --lr
over --lr-warmup-epochs and falls linearly to 0 at the last epoch (the blog's schedule).

Log (stdout and LOGDIR/NAME.log, rank 0) and LOGDIR/NAME.json: per epoch the training loss and
accuracy, validation accuracy, bytes pushed per step and compression ratio.
"""
import argparse
import os
import sys

import numpy as np
import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from cifar100_data import augment, epoch_batches, prefetch  # noqa: E402
from cifar10_data import CLASSES, load_split, normalize  # noqa: E402
from study_flags import OneLineParser, add_study_args, study_compression  # noqa: E402
from study_training import distribute, start_job, train_and_summarize  # noqa: E402
from torch_device import add_device_arg, pinned  # noqa: E402
from training_utils import steps_per_epoch  # noqa: E402

NETWORKS = ("resnet9", "alexnet")


def build_parser():
    p = OneLineParser(description="CIFAR-10 ResNet-9 / AlexNet with the layer-wise study's and DGC's "
                                            "compression flags, under torchrun or bpslaunch.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--network", "-n", type=lambda s: s.strip().lower(), default="resnet9", choices=NETWORKS)
    p.add_argument("--width", type=int, default=64,
                   help="channels of the first layer (the blog's 64); the others scale with it")
    p.add_argument("--data-dir", "--data_dir", default="~/data",
                   help="directory holding cifar-10-batches-py/ (nothing is downloaded)")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=512, help="mini-batch per worker")
    p.add_argument("--lr", type=float, default=0.4, help="peak learning rate")
    p.add_argument("--lr-warmup-epochs", type=float, default=5, help="epochs of the linear rise to --lr")
    p.add_argument("--wd", type=float, default=5e-4, help="weight decay")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order and augmentation")
    p.add_argument("-j", "--num-data-workers", dest="num_workers", type=int, default=2,
                   help="threads preparing batches (0: in the training loop)")
    p.add_argument("--max-iters", type=int, default=0, help="at most this many steps per epoch (0: all)")
    p.add_argument("--logdir", default=".", help="where NAME.log and NAME.json go")
    p.add_argument("--name", default="cifar10", help="name of the run")
    add_device_arg(p, default="cuda")  # the study trains on CUDA; without a GPU: a note, the CPU
    add_study_args(p)
    return p


# ---------------------------------------------------------------------------------------- models

def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Residual(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.body = nn.Sequential(conv_bn(channels, channels), conv_bn(channels, channels))

    def forward(self, x):
        return x + self.body(x)


class Mul(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x * self.weight


def resnet9(width=64, classes=CLASSES):
    """The blog's ResNet-9: prep (w), layer1 (2w, pool, residual), layer2 (4w, pool),
    layer3 (8w, pool, residual), global max pool, linear without bias, logits scaled by 1/8."""
    w = width
    return nn.Sequential(
        conv_bn(3, w),
        conv_bn(w, 2 * w), nn.MaxPool2d(2), Residual(2 * w),
        conv_bn(2 * w, 4 * w), nn.MaxPool2d(2),
        conv_bn(4 * w, 8 * w), nn.MaxPool2d(2), Residual(8 * w),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8 * w, classes, bias=False), Mul(0.125))


def alexnet(width=64, classes=CLASSES):
    """AlexNet's five convolutions and three fully connected layers, sized for 32x32 inputs:
    3x3 convolutions of w, 3w, 6w, 4w, 4w channels (64, 192, 384, 256, 256 at w = 64) with
    max pooling to 4x4, then 16w-wide hidden layers with dropout."""
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(w, 3 * w, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(3 * w, 6 * w, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(6 * w, 4 * w, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(4 * w, 4 * w, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.5), nn.Linear(4 * w * 16, 16 * w), nn.ReLU(inplace=True),
        nn.Dropout(0.5), nn.Linear(16 * w, 16 * w), nn.ReLU(inplace=True), nn.Linear(16 * w, classes))


def build_model(name, width):
    if width < 1:
        raise SystemExit(f"--width must be >= 1, got {width}")
    return {"resnet9": resnet9, "alexnet": alexnet}[name](width)


def blog_lr(args, epoch):
    """Linear from 0 to --lr at --lr-warmup-epochs, then linear to 0 at --epochs."""
    warm = min(args.lr_warmup_epochs, args.epochs)
    if epoch < warm:
        return args.lr * epoch / warm
    return args.lr * max(0.0, (args.epochs - epoch) / max(args.epochs - warm, 1e-9))


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.epochs < 1:
        parser.error("--batch-size and --epochs must be >= 1")
    params = study_compression(args, parser)
    train_x, train_y = load_split(args.data_dir, "train", "--data-dir")
    test_x, test_y = load_split(args.data_dir, "test", "--data-dir")
    rank, size, logger, device = start_job(args, os.path.basename(__file__), "cifar10_resnet9")
    logger.info("compression_params: %s on %d workers", params, size)

    torch.manual_seed(args.seed)
    model = build_model(args.network, args.width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd,
                          nesterov=args.nesterov and args.momentum > 0)
    opt = distribute(opt, model, params, "train_cifar10_resnet9")

    steps = steps_per_epoch(len(train_x) // size, len(train_x), size, args.batch_size, args.max_iters)
    val_x, val_y = test_x[rank::size], test_y[rank::size]

    def batch(item):
        epoch, i, indices = item
        rng = np.random.default_rng([args.seed, rank, epoch, i])
        return pinned((torch.from_numpy(normalize(augment(train_x[indices], rng))),
                       torch.from_numpy(train_y[indices])), device)

    def val_batches(epoch):
        for start in range(0, len(val_y), 2 * args.batch_size):
            end = start + 2 * args.batch_size
            yield torch.from_numpy(normalize(val_x[start:end])), torch.from_numpy(val_y[start:end])

    train_and_summarize(args, params, model, opt, logger, args.num_workers, epochs=args.epochs,
                        train_batches=lambda epoch, executor: (steps, prefetch(executor, batch, epoch_batches(
                            args.seed, epoch, len(train_x), rank, size, steps, args.batch_size),
                            max(1, args.num_workers))),
                        val_batches=val_batches, lr_at=lambda e: blog_lr(args, e), device=device)


if __name__ == "__main__":
    main()
