#!/usr/bin/env python3
"""Train a gluoncv model on ImageNet with bps_gc.mxnet and gradient compression.

BytePS's example/mxnet/train_gluon_imagenet_byteps_gc.py (gluoncv's train_imagenet.py on
BytePS) with its command line, on bps_gc:

    bpslaunch --local --workers 2 --servers 1 -- \\
        python example/mxnet/train_gluon_imagenet_byteps_gc.py --model resnet50_v2 \\
        --use-rec --rec-train ~/data/imagenet/train.rec --rec-train-idx ~/data/imagenet/train.idx \\
        --rec-val ~/data/imagenet/val.rec --rec-val-idx ~/data/imagenet/val.idx \\
        --compressor topk --k 0.01 --ef vanilla --compress-momentum nesterov

Data, sharded over the workers (imagenet_data.py):
* ``--use-rec``: RecordIO files (im2rec.py, or mxnet.recordio's MXIndexedRecordIO +
  pack_img) read by mx.io.ImageRecordIter with ``part_index=rank, num_parts=size``;
* otherwise an image folder, ``--data-dir``/{train,val}/<class>/<image>, read by
  gluon.data.vision.ImageFolderDataset (class index: the sorted folder names); worker r takes
  every size()-th image, so every worker sees every class.
Augmentation as gluoncv's: random resized crop, flip, colour jitter and PCA lighting noise for
training; resize to input-size / crop-ratio and a centre crop for validation.

Every worker runs the same number of steps per epoch (its share of the training set,
rounded down to whole batches, at most ``--max-iters``); a sync job would hang otherwise.
Accuracies are over all workers, weighted by samples (counts summed with push_pull); padding
that ImageRecordIter adds to a last validation batch is not counted.

Log (stdout and --logging-file, rank 0):
    Epoch[N] Batch [I]<TAB>Speed: X samples/sec<TAB>err-top1=E<TAB>lr=L  (every --log-interval; rank 0's own)
    [Epoch N] training: err-top1=E
    [Epoch N] speed: X samples/sec<TAB>time cost: Y      (X: all workers together)
    [Epoch N] validation: err-top1=E1 err-top5=E5       (top-5: top-min(5, classes))
    [Epoch N] traffic per worker: pushed ... MB (... MB uncompressed, ratio R)   (if any)
"""
import argparse
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import bps_gc.core
import bps_gc.mxnet as bps
import common  # also puts example/ on sys.path
from compression_flags import add_compression_args, compression_params
from imagenet_data import FolderData, RecordData
from training_utils import log_traffic, make_logger, steps_per_epoch


def build_parser():
    parser = argparse.ArgumentParser(
        description="Train a model for ImageNet image classification with bps_gc.")
    parser.add_argument("--data-dir", type=str, default="~/.mxnet/datasets/imagenet",
                        help="image folder with train/<class>/* and val/<class>/* (without --use-rec)")
    parser.add_argument("--rec-train", type=str, default="~/.mxnet/datasets/imagenet/rec/train.rec",
                        help="the training RecordIO file")
    parser.add_argument("--rec-train-idx", type=str, default="~/.mxnet/datasets/imagenet/rec/train.idx",
                        help="the index of the training RecordIO file")
    parser.add_argument("--rec-val", type=str, default="~/.mxnet/datasets/imagenet/rec/val.rec",
                        help="the validation RecordIO file")
    parser.add_argument("--rec-val-idx", type=str, default="~/.mxnet/datasets/imagenet/rec/val.idx",
                        help="the index of the validation RecordIO file")
    parser.add_argument("--use-rec", action="store_true",
                        help="read the RecordIO files (default: the image folder)")
    parser.add_argument("--batch-size", type=int, default=32, help="training batch size per worker")
    parser.add_argument("--dtype", type=str, default="float32",
                        help="data type of the network: float32 or float16")
    parser.add_argument("--num-gpus", type=int, default=0,
                        help="0: train on the CPU; > 0: on GPU local_rank (one process per GPU)")
    parser.add_argument("-j", "--num-data-workers", dest="num_workers", default=4, type=int,
                        help="preprocessing threads")
    parser.add_argument("--num-epochs", type=int, default=3, help="number of training epochs")
    parser.add_argument("--lr", type=float, default=0.1,
                        help="learning rate per worker machine (scaled by size / local_size)")
    parser.add_argument("--momentum", type=float, default=0.9, help="momentum")
    parser.add_argument("--wd", type=float, default=0.0001, help="weight decay")
    parser.add_argument("--lr-mode", type=str, default="step", choices=("step", "poly", "cosine"),
                        help="learning rate schedule after the warm-up")
    parser.add_argument("--lr-decay", type=float, default=0.1, help="step mode: decay factor")
    parser.add_argument("--lr-decay-period", type=int, default=0,
                        help="step mode: decay every this many epochs (0: use --lr-decay-epoch)")
    parser.add_argument("--lr-decay-epoch", type=str, default="40,60",
                        help="step mode: epochs at which the rate decays, comma-separated")
    parser.add_argument("--warmup-lr", type=float, default=0.0,
                        help="learning rate at the start of the warm-up")
    parser.add_argument("--warmup-epochs", type=int, default=0, help="epochs of linear warm-up")
    parser.add_argument("--last-gamma", action="store_true",
                        help="initialize the gamma of the last BN layer of each residual block to 0")
    parser.add_argument("--mode", type=str, default=None, choices=common.MODES,
                        help="imperative (default) or hybrid (hybrib, as BytePS's recipe prints it: imperative, with a note)")
    parser.add_argument("--model", type=str, required=True,
                        help="gluoncv model zoo name (resnet50_v1, resnet18_v2, mobilenet1.0, ...)")
    parser.add_argument("--num-classes", type=int, default=1000, help="number of classes")
    parser.add_argument("--input-size", type=int, default=224, help="size of the input images")
    parser.add_argument("--crop-ratio", type=float, default=0.875,
                        help="validation: centre crop of this ratio of the resized image")
    parser.add_argument("--use-pretrained", action="store_true",
                        help="not available: pretrained weights would have to be downloaded")
    parser.add_argument("--use-se", "--use_se", dest="use_se", action="store_true",
                        help="use SE layers in resnext")
    parser.add_argument("--batch-norm", action="store_true", help="use batch normalization in vgg")
    parser.add_argument("--save-frequency", type=int, default=10,
                        help="save parameters and trainer states every this many epochs (0: never)")
    parser.add_argument("--save-dir", type=str, default="params", help="directory of saved models")
    parser.add_argument("--resume-epoch", type=int, default=0, help="epoch to resume from")
    parser.add_argument("--resume-params", type=str, default="", help="parameters to load")
    parser.add_argument("--resume-states", type=str, default="",
                        help="trainer states to load: the optimizer's, and this rank's codec "
                             "state (error feedback, momentum, the servers' state) saved beside "
                             "it as <file>.bps_gc.rank<r>")
    parser.add_argument("--log-interval", type=int, default=50,
                        help="log every this many batches (0: never)")
    parser.add_argument("--logging-file", type=str, default="train_imagenet.log",
                        help="the log file (rank 0)")
    parser.add_argument("--max-iters", type=int, default=0,
                        help="at most this many steps per epoch (0: the whole training set)")
    add_compression_args(parser)
    return parser


# ------------------------------------------------------------------------------------- training

def topk_correct(output, label, real, k):
    """(top-1 correct, top-k correct) among the first ``real`` rows."""
    scores = output[:real].astype("float32").asnumpy()
    labels = label[:real].asnumpy().astype(np.int64)
    k = min(k, scores.shape[1])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    top1 = scores.argmax(axis=1)
    return int((top1 == labels).sum()), int((top == labels[:, None]).any(axis=1).sum())


def build_net(args, gluoncv, ctx):
    kwargs = {"classes": args.num_classes, "pretrained": False}
    if args.model.startswith("vgg"):
        kwargs["batch_norm"] = args.batch_norm
    elif args.model.startswith("resnext"):
        kwargs["use_se"] = args.use_se
    if args.last_gamma:
        kwargs["last_gamma"] = True
    try:
        net = gluoncv.model_zoo.get_model(args.model, **kwargs)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--model {args.model!r}: {e}")
    net.cast(args.dtype)
    if args.resume_params:
        net.load_parameters(os.path.expanduser(args.resume_params), ctx=ctx)
    else:
        net.initialize(mx.init.MSRAPrelu(), ctx=ctx)
    if args.mode == "hybrid":
        net.hybridize(static_alloc=True, static_shape=True)
    return net


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.use_pretrained:
        parser.error("--use-pretrained needs gluoncv's pretrained weights, which would be "
                     "downloaded; this example downloads nothing. Train from scratch, or load "
                     "weights you have with --resume-params FILE")
    if args.batch_size < 1 or args.num_classes < 1 or args.input_size < 1:
        parser.error("--batch-size, --num-classes and --input-size must be >= 1")
    if not 0 < args.crop_ratio <= 1:
        parser.error("--crop-ratio must be in (0, 1]")
    if args.dtype not in ("float32", "float16"):
        parser.error("--dtype: float32 or float16")
    if not 0 <= args.resume_epoch <= args.num_epochs:
        parser.error("--resume-epoch must be in [0, --num-epochs]")
    comp_params = compression_params(args, parser)
    import gluoncv  # here, not at the top: --help stays fast; bps_gc.mxnet made it importable

    bps.init()
    rank, size = bps.rank(), bps.size()
    ctx, _, device_note = common.device(args.num_gpus)
    logger = make_logger("imagenet", args.logging_file, rank)
    for note in (device_note, common.mode_note(args.mode)):
        if note:
            logger.info(note)
    logger.info(args)
    common.seed_everything(args.seed, rank)

    data = RecordData(args, rank, size) if args.use_rec else FolderData(args, rank, size)
    steps = steps_per_epoch(data.train_share, data.train_records, size, args.batch_size, args.max_iters)

    net = build_net(args, gluoncv, ctx)
    schedule = common.lr_scheduler(args, steps, args.lr_mode)
    optimizer_params = {"lr_scheduler": schedule, "wd": args.wd, "momentum": args.momentum,
                        "begin_num_update": args.resume_epoch * steps}
    if args.dtype == "float16":
        optimizer_params["multi_precision"] = True
    trainer = bps.DistributedTrainer(net.collect_params(), common.optimizer_name(args),
                                     optimizer_params, compression_params=comp_params)
    if args.resume_states:
        # the saved optimizer (its state and update count) replaces ours; resume with the
        # compression flags of the saved run. Its schedule was made for that run's
        # --num-epochs: this run's takes over.
        trainer.load_states(os.path.expanduser(args.resume_states))
        trainer.optimizer.lr_scheduler = schedule
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    save_dir = args.save_dir if args.save_dir and args.save_frequency > 0 else ""

    def save(stem):  # every rank: each saves its own codec state
        common.save_checkpoint(net, trainer, os.path.join(save_dir, stem))

    def validate():
        top1 = top5 = seen = 0
        for x, y, real in data.val_batches():
            output = net(x.as_in_context(ctx).astype(args.dtype, copy=False))
            c1, c5 = topk_correct(output, y, real, 5)
            top1, top5, seen = top1 + c1, top5 + c5, seen + real
        return [top1, top5, seen]

    best_err = 1.0
    bps_gc.core.metrics()  # reset: traffic is reported per epoch
    for epoch in range(args.resume_epoch, args.num_epochs):
        tic = btic = time.time()
        correct = seen = 0
        for i, (x, y, real) in enumerate(common.take(data.train_batches(), steps, "training data")):
            if real != args.batch_size:  # steps counts whole batches of every worker's share
                raise RuntimeError(f"training batch {i} of epoch {epoch} has {real} images, "
                                   f"not {args.batch_size}")
            x = x.as_in_context(ctx).astype(args.dtype, copy=False)
            label = y.as_in_context(ctx)
            with autograd.record():
                output = net(x)
                loss = loss_fn(output, label.astype(args.dtype, copy=False))
            loss.backward()
            trainer.step(args.batch_size)
            c1, _ = topk_correct(output, y, x.shape[0], 1)
            correct, seen = correct + c1, seen + x.shape[0]
            if args.log_interval and (i + 1) % args.log_interval == 0:
                logger.info("Epoch[%d] Batch [%d]\tSpeed: %f samples/sec\terr-top1=%f\tlr=%f",
                            epoch, i, args.batch_size * args.log_interval / (time.time() - btic),
                            1 - correct / seen, trainer.learning_rate)
                btic = time.time()
        elapsed = time.time() - tic
        train_correct, train_seen = common.summed([correct, seen], "metric.train")
        val_top1, val_top5, val_seen = common.summed(validate(), "metric.val")
        err_top1 = 1 - val_top1 / val_seen if val_seen else 1.0
        err_top5 = 1 - val_top5 / val_seen if val_seen else 1.0
        logger.info("[Epoch %d] training: err-top1=%f", epoch, 1 - train_correct / train_seen)
        logger.info("[Epoch %d] speed: %d samples/sec\ttime cost: %f",
                    epoch, int(train_seen / elapsed), elapsed)
        logger.info("[Epoch %d] validation: err-top1=%f err-top5=%f", epoch, err_top1, err_top5)
        log_traffic(logger, epoch)
        if save_dir:  # the metrics are sums over all workers: every rank decides alike
            if err_top1 < best_err:
                best_err = err_top1
                save(f"{best_err:.4f}-imagenet-{args.model}-{epoch}-best")
            if (epoch + 1) % args.save_frequency == 0:
                save(f"imagenet-{args.model}-{epoch}")
    if save_dir and args.num_epochs > args.resume_epoch:
        save(f"imagenet-{args.model}-{args.num_epochs - 1}")
    bps.shutdown()


if __name__ == "__main__":
    main()
