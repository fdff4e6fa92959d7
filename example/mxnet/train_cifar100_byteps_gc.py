#!/usr/bin/env python3
"""Train a gluoncv model on CIFAR-100 with bps_gc.mxnet and gradient compression.

BytePS's example/mxnet/train_cifar100_byteps_gc.py with its command line, on bps_gc:

    bpslaunch --local --workers 2 --servers 1 -- \\
        python example/mxnet/train_cifar100_byteps_gc.py --data-dir ~/data/cifar100 \\
        --model cifar_resnet20_v1 --compressor onebit --onebit-scaling --ef vanilla \\
        --compress-momentum nesterov

What differs from BytePS's script (where it was wrong):
* the 100 fine labels (BytePS read gluon's CIFAR100 with its default coarse, 20-class labels
  into a 100-class network);
* a model that exists by default (``resnet18_v2``; BytePS's ``resnet`` is no gluoncv model);
* ``--num-gpus 0`` trains on the CPU, with no nvidia-smi call;
* training and validation accuracy are over all workers, weighted by samples (the correct
  and total counts are summed with push_pull), not a mean of per-worker ratios;
* only rank 0 writes the log file and checkpoints;
* every worker runs the same number of steps per epoch (a sync job would hang otherwise).

Data: the official CIFAR-100 python version, DATA_DIR/cifar-100-python/{train,test} (pickled
dicts with b'data', uint8 N x 3072, and b'fine_labels'), as unpacked from
cifar-100-python.tar.gz. These local files are trusted input (pickle); nothing received over
the network is unpickled. Training images get 4-pixel zero padding + a random 32x32 crop and a
random horizontal flip; all are normalized with the CIFAR-100 mean/std. Each epoch the
training set is shuffled the same way on every worker and each worker takes every size()-th
image; the test set is split the same way.

Log (stdout and <log-dir>/cifar100-<size>-<cpu|gpu>-<logging-file>.log, rank 0; --log-dir is out/
under the working directory unless given):
    [Epoch N] speed: X samples/sec<TAB>time cost: Y      (X: all workers together)
    [Epoch N] training: accuracy=A
    [Epoch N] validation: accuracy=B
    [Epoch N] traffic per worker: pushed ... MB (... MB uncompressed, ratio R)   (if any)
"""
import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import bps_gc.core
import bps_gc.mxnet as bps
from bps_gc.mxnet.trainer_state import write_atomically
import common  # also puts example/ on sys.path
from compression_flags import add_compression_args, compression_params
from cifar100_data import CLASSES, augment, epoch_batches, load_split, normalize, prefetch
from training_utils import log_traffic, make_logger, steps_per_epoch


def build_parser():
    parser = argparse.ArgumentParser(
        description="Train a model for CIFAR-100 image classification with bps_gc.")
    parser.add_argument("--data-dir", type=str, default="~/.mxnet/datasets/cifar100",
                        help="directory holding cifar-100-python/{train,test}")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="training batch size per worker")
    parser.add_argument("--num-gpus", type=int, default=0,
                        help="0: train on the CPU; > 0: on GPU local_rank (one process per GPU)")
    parser.add_argument("--model", type=str, default="resnet18_v2",
                        help="gluoncv model zoo name, e.g. resnet18_v2, cifar_resnet20_v1, "
                             "cifar_resnet56_v1, cifar_wideresnet16_10 (built with 100 classes, "
                             "no pretrained weights)")
    parser.add_argument("-j", "--num-data-workers", dest="num_workers", default=4, type=int,
                        help="threads preparing batches (0: in the training loop)")
    parser.add_argument("--num-epochs", type=int, default=200, help="number of training epochs")
    parser.add_argument("--lr", type=float, default=0.1,
                        help="learning rate per worker machine (scaled by size / local_size)")
    parser.add_argument("--momentum", type=float, default=0.9, help="momentum")
    parser.add_argument("--wd", type=float, default=0.0005, help="weight decay")
    parser.add_argument("--lr-decay", type=float, default=0.1, help="learning rate decay factor")
    parser.add_argument("--lr-decay-period", type=int, default=0,
                        help="decay every this many epochs (0: use --lr-decay-epoch)")
    parser.add_argument("--lr-decay-epoch", type=str, default="100,150",
                        help="epochs at which the learning rate decays, comma-separated")
    parser.add_argument("--warmup-lr", type=float, default=0.0,
                        help="learning rate at the start of the warm-up")
    parser.add_argument("--warmup-epochs", type=int, default=0, help="epochs of linear warm-up")
    parser.add_argument("--drop-rate", type=float, default=0.0,
                        help="dropout rate of the wide ResNets (cifar_wideresnet*)")
    parser.add_argument("--mode", type=str, default=None, choices=common.MODES,
                        help="imperative (default) or hybrid (hybrib, as BytePS's recipe prints it: imperative, with a note)")
    parser.add_argument("--save-period", type=int, default=10,
                        help="save the parameters every this many epochs (0: never)")
    parser.add_argument("--save-dir", type=str, default="params", help="directory of saved models")
    parser.add_argument("--resume-from", type=str, default="",
                        help="parameters (.params) to start from")
    parser.add_argument("--resume-states", type=str, default="",
                        help="trainer states (.states) to resume: the optimizer's, and this "
                             "rank's codec state saved beside it (<file>.bps_gc.rank<r>)")
    parser.add_argument("--resume-epoch", type=int, default=0,
                        help="epoch to start at (with --resume-from; the schedule starts there)")
    parser.add_argument("--logging-file", type=str, default="baseline",
                        help="log file: <log-dir>/cifar100-<size>-<device>-<logging-file>.log")
    parser.add_argument("--log-dir", type=str, default="out", help="directory of the log file (made if missing)")
    parser.add_argument("--max-iters", type=int, default=0,
                        help="at most this many steps per epoch (0: the whole training set)")
    add_compression_args(parser)
    return parser


# ------------------------------------------------------------------------------------- training

def evaluate(net, images, labels, batch_size, ctx):
    """(correct, count) of the network on these images."""
    correct = 0
    for start in range(0, len(images), batch_size):
        x = mx.nd.array(normalize(images[start:start + batch_size]), ctx=ctx)
        pred = net(x).argmax(axis=1).asnumpy().astype(np.int64)
        correct += int((pred == labels[start:start + batch_size]).sum())
    return correct, len(images)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if not 0 <= args.resume_epoch <= args.num_epochs:
        parser.error("--resume-epoch must be in [0, --num-epochs]")
    comp_params = compression_params(args, parser)
    import gluoncv  # here, not at the top: --help stays fast; bps_gc.mxnet made it importable

    bps.init()
    rank, size = bps.rank(), bps.size()
    ctx, device_name, device_note = common.device(args.num_gpus)
    logger = make_logger("cifar100", os.path.join(args.log_dir, f"cifar100-{size}-{device_name}-{args.logging_file}.log"),
                         rank)
    for note in (device_note, common.mode_note(args.mode)):
        if note:
            logger.info(note)
    logger.info(args)
    common.seed_everything(args.seed, rank)

    train_x, train_y = load_split(args.data_dir, "train")
    test_x, test_y = load_split(args.data_dir, "test")
    steps = steps_per_epoch(len(train_x) // size, len(train_x), size, args.batch_size, args.max_iters)
    val_x, val_y = test_x[rank::size], test_y[rank::size]

    kwargs = {"classes": CLASSES}
    if args.model.startswith("cifar_wideresnet"):
        kwargs["drop_rate"] = args.drop_rate
    try:
        net = gluoncv.model_zoo.get_model(args.model, **kwargs)
    except ValueError as e:
        raise SystemExit(f"--model {args.model!r}: {e}")
    if args.resume_from:
        net.load_parameters(args.resume_from, ctx=ctx)
    else:
        net.initialize(mx.init.Xavier(), ctx=ctx)
    if args.mode == "hybrid":
        net.hybridize()

    optimizer_params = {"lr_scheduler": common.lr_scheduler(args, steps, "step"),
                        "wd": args.wd, "momentum": args.momentum,
                        "begin_num_update": args.resume_epoch * steps}
    # rank 0's parameters are broadcast at the first step
    trainer = bps.DistributedTrainer(net.collect_params(), common.optimizer_name(args),
                                     optimizer_params, compression_params=comp_params)
    if args.resume_states:
        schedule = trainer.optimizer.lr_scheduler  # this run's, made for its --num-epochs
        trainer.load_states(args.resume_states)
        trainer.optimizer.lr_scheduler = schedule
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    save_dir = args.save_dir if args.save_dir and args.save_period > 0 else ""

    def batch(item):
        epoch, i, indices = item
        rng = np.random.default_rng([args.seed, rank, epoch, i])
        x = normalize(augment(train_x[indices], rng))
        return mx.nd.array(x, ctx=ctx), train_y[indices]

    executor = ThreadPoolExecutor(args.num_workers) if args.num_workers > 0 else None
    best_val = 0.0
    bps_gc.core.metrics()  # reset: traffic is reported per epoch
    try:
        for epoch in range(args.resume_epoch, args.num_epochs):
            tic = time.time()
            items = epoch_batches(args.seed, epoch, len(train_x), rank, size, steps, args.batch_size)
            correct = seen = 0
            for x, y in prefetch(executor, batch, items, max(1, args.num_workers)):
                label = mx.nd.array(y, ctx=ctx)
                with autograd.record():
                    output = net(x)
                    loss = loss_fn(output, label)
                loss.backward()
                trainer.step(args.batch_size)
                correct += int((output.argmax(axis=1).asnumpy().astype(np.int64) == y).sum())
                seen += len(y)
            elapsed = time.time() - tic
            train_correct, train_seen = common.summed([correct, seen], "metric.train")
            logger.info("[Epoch %d] speed: %d samples/sec\ttime cost: %f",
                        epoch, int(train_seen / elapsed), elapsed)
            logger.info("[Epoch %d] training: accuracy=%f", epoch, train_correct / train_seen)
            val_correct, val_seen = common.summed(
                list(evaluate(net, val_x, val_y, args.batch_size, ctx)), "metric.val")
            val_acc = val_correct / val_seen if val_seen else 0.0
            logger.info("[Epoch %d] validation: accuracy=%f", epoch, val_acc)
            log_traffic(logger, epoch)
            if save_dir:  # the metrics are sums over all workers: every rank decides alike
                if val_acc > best_val and rank == 0:
                    best_val = val_acc
                    write_atomically(os.path.join(
                        save_dir, f"{best_val:.4f}-cifar100-{args.model}-{epoch}-best.params"), net.save_parameters)
                if (epoch + 1) % args.save_period == 0:  # parameters, optimizer and codec state
                    common.save_checkpoint(net, trainer, os.path.join(save_dir, f"cifar100-{args.model}-{epoch}"))
        if save_dir and args.num_epochs > args.resume_epoch:
            common.save_checkpoint(net, trainer, os.path.join(save_dir, f"cifar100-{args.model}-{args.num_epochs - 1}"))
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
