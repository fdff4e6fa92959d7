#!/usr/bin/env python3
"""Train a CIFAR-10 ResNet with synchronous SGD, (post-)local SGD, CHOCO-SGD or D-PSGD on bps_gc,
with the flags of the seed scripts (see seed_flags.py and --help). The CHOCO seed's command runs
with bpslaunch in front of it and this script in place of run.py:

    bpslaunch --local --workers 8 --servers 1 -- python example/pytorch/train_cifar10_choco.py \\
        --arch resnet20 --optimizer parallel_choco --avg_model True --experiment demo \\
        --data cifar10 --data_dir ~/data --batch_size 128 --base_batch_size 64 --num_workers 2 \\
        --num_epochs 300 --partition_data random --reshuffle_per_epoch True --stop_criteria epoch \\
        --n_mpi_process 8 --lr 0.1 --lr_scaleup True --lr_scaleup_factor graph --lr_warmup True \\
        --lr_warmup_epochs 5 --lr_scheduler MultiStepLR --lr_decay 0.1 --lr_milestones 150,225 \\
        --comm_op sign --consensus_stepsize 0.45 --weight_decay 1e-4 --use_nesterov True \\
        --momentum_factor 0.9 --graph_topology ring --track_time True --display_tracked_time True

The command as the CHOCO README prints it (16 workers, --world's 8 GPU ids) runs the same way
with `bpslaunch --local --workers 16 -- python example/pytorch/train_cifar10_choco.py` in place of
its python and run.py (docs/seeds.md); --dry-run joins the job, checks the flags against it and
logs the plan and every note without training.

Log lines (stdout and <experiment>.log, rank 0): per epoch the training accuracy, each worker's
test accuracy and their mean, the averaged model's (CHOCO, D-PSGD, or --evaluate_avg), and the
bytes each worker sent per step (to the servers, and to its graph neighbours); <experiment>.json
keeps the same numbers.
"""
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import bps_gc.core
from bps_gc.algorithms.topology import check_spec, topology

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from cifar100_data import augment, epoch_batches, prefetch  # noqa: E402
from cifar10_data import CLASSES, load_split, normalize  # noqa: E402
from seed_flags import algorithm, build_parser, compression, unused_flag_notes  # noqa: E402
from torch_device import on_device, pick_device, pinned  # noqa: E402
from training_utils import make_logger  # noqa: E402

torch = F = bps = resnet = None  # import_torch(): a --dry-run joins the job without them


def import_torch():
    """torch and bps_gc.torch, for a real run (16 workers' --dry-run on a small machine stays light)."""
    global torch, F, bps, resnet
    import torch
    import torch.nn.functional as F

    import bps_gc.torch as bps
    from train_cifar100_byteps_gc import resnet


def check_job(args, parser, size):
    """The seeds' MPI flags against the job bpslaunch started."""
    if args.n_mpi_process is not None and args.n_mpi_process != size:
        raise SystemExit(f"--n_mpi_process {args.n_mpi_process} but bpslaunch started {size} workers: "
                         f"use bpslaunch --local --workers {args.n_mpi_process} (or change the flag)")
    if args.n_sub_process != 1:
        raise SystemExit(f"--n_sub_process {args.n_sub_process}: one device per worker here; start "
                         f"{size * args.n_sub_process} workers instead")
    return world_notes(args, size * args.n_sub_process)


def world_notes(args, processes):
    """--world: GPU ids, one per process or a pattern the processes repeat (the CHOCO README's 8
    ids for 16 processes); unused here. More ids than processes, or a non-id, cannot be meant."""
    if args.world is None:
        return []
    ids = [w.strip() for w in args.world.split(",")]
    if not all(w.isdigit() for w in ids):
        raise SystemExit(f"--world {args.world}: want comma-separated GPU ids (whole numbers >= 0)")
    if len(ids) > processes:
        raise SystemExit(f"--world lists {len(ids)} devices for {processes} worker processes: the extra ones would "
                         "have no process")
    repeat = "" if len(ids) == processes else f", repeated over the {processes} processes"
    use = "each process trains on its id's GPU" if on_cuda(args) else "unused (--on_cuda False: the CPU)"
    return [f"--world {args.world}: {len(ids)} GPU ids{repeat}; {use}"]


def on_cuda(args):
    return args.device.startswith("cuda") if args.device else args.on_cuda


def requested_device(args, rank):
    """The --device word the seed's flags mean for worker ``rank``: --on_cuda True trains on
    CUDA, on GPU --world[rank] (the ids repeat) if given, else local rank's; --device overrides."""
    if args.device:
        return args.device
    if not args.on_cuda:
        return "cpu"
    ids = [w.strip() for w in args.world.split(",")] if args.world else []
    return f"cuda:{ids[rank % len(ids)]}" if ids else "cuda"


def cluster_notes(args):
    notes = []
    if args.comm_device == "cuda":
        notes.append("--comm_device cuda: the codecs run on the GPU where the model is there (device chains); "
                     "the payloads cross host memory to be sent (ZeroMQ or gloo)")
    if args.use_ipc:
        notes.append("--use_ipc: bps_gc's ZeroMQ sockets carry the messages")
    for flag in ("hostfile", "mpi_path", "python_path"):
        if getattr(args, flag):
            notes.append(f"--{flag} not read: bpslaunch starts the processes")
    return notes


def peak_lr(args, size):
    lr = args.lr * (args.batch_size / args.base_batch_size if args.base_batch_size else 1.0)
    if args.lr_scaleup:
        factor = args.lr_scaleup_factor
        if factor == "graph":
            topo = topology(args.graph_topology, size)
            lr *= 1 + max(len(topo.neighbours(r)) for r in range(size))
        elif factor == "world":
            lr *= size
        else:
            try:
                lr *= float(factor)
            except ValueError:
                raise SystemExit(f"--lr_scaleup_factor: graph, world or a number, got {factor!r}")
    return lr


def learning_rate(args, epoch, peak, changes):
    """At fractional ``epoch``: linear warm-up from --lr, then step decay at ``changes``."""
    if args.lr_warmup and epoch < args.lr_warmup_epochs:
        return args.lr + (peak - args.lr) * epoch / args.lr_warmup_epochs
    factor = args.lr_decay if args.lr_decay <= 1 else 1.0 / args.lr_decay
    return peak * factor ** sum(1 for e in changes if epoch >= e)


def wrap(args, parser, opt, model, size):
    name, _ = algorithm(args)
    params = compression(args, parser)
    named = list(model.named_parameters())
    if name == "sgd":
        return bps.DistributedOptimizer(opt, named_parameters=named, compression_params=params)
    if name in ("local_sgd", "post_local_sgd"):
        if name == "post_local_sgd" and args.turn_on_local_step_from <= 0:
            parser.error("--optimizer post_local_sgd needs --turn_on_local_step_from > 0 (the switch epoch)")
        return bps.LocalSGD(opt, named, local_steps=args.local_step, compression_params=params,
                            local_from_epoch=args.turn_on_local_step_from)
    return bps.DecentralizedOptimizer(opt, named, algorithm="choco" if name == "parallel_choco" else "dpsgd",
                                      topology=args.graph_topology, consensus_stepsize=args.consensus_stepsize,
                                      compression_params=params)


def summed(values, name):
    t = torch.tensor(values, dtype=torch.float64)
    return bps.push_pull(t, average=False, name=name).tolist()


def accuracy(model, images, labels, batch_size=256):
    model.eval()
    correct = 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            x, y = next(on_device([(torch.from_numpy(normalize(images[start:start + batch_size])),
                                    torch.from_numpy(labels[start:start + batch_size]))], device))
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return correct


def averaged(model):
    """{name: parameter averaged over all workers} (buffers stay local)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = bps.push_pull(p.detach().clone(), average=True, name=f"average.{name}")
    return out


def evaluate(model, test_x, test_y, rank, size, with_average):
    """Each worker's accuracy on the whole test set, and the averaged model's (sharded)."""
    own = np.zeros(size)
    own[rank] = accuracy(model, test_x, test_y) / len(test_y)
    result = {"workers": summed(own.tolist(), "eval.workers")}
    if with_average:
        mine = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for name, value in averaged(model).items():
                dict(model.named_parameters())[name].copy_(value)
            correct = accuracy(model, test_x[rank::size], test_y[rank::size])
            for name, p in model.named_parameters():
                p.copy_(mine[name])
        c, n = summed([correct, len(test_y[rank::size])], "eval.average")
        result["average"] = c / n
    return result


def dry_run_plan(args, logger, params, peak, changes, images_per_worker, size):
    """--dry-run: what the run would do, then no training."""
    name, _ = algorithm(args)
    graph = f", {topology(args.graph_topology, size).name}" if name in ("parallel_choco", "dpsgd") else ""
    logger.info("dry run: %s on %d workers%s", name, size, graph)
    epochs = sorted({0, args.lr_warmup_epochs if args.lr_warmup else 0, *changes})
    rates = ", ".join(f"epoch {e}: {learning_rate(args, e, peak, changes):g}" for e in epochs)
    length = f"{args.num_epochs} epochs" if args.stop_criteria == "epoch" else f"{args.num_iterations} steps"
    steps = images_per_worker // args.batch_size
    logger.info("dry run: compression_params %s; learning rate %s; %s of %d steps each (%d images per worker, "
                "batch %d%s); no training", params, rates, length, steps, images_per_worker, args.batch_size,
                ": too few images for a batch" if steps == 0 else "")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.local_step < 1:
        parser.error("--batch_size and --local_step must be >= 1")
    changes = [int(e) for e in args.lr_change_epochs.split(",") if e.strip()]
    compression(args, parser)  # flag errors before the cluster waits on us
    if algorithm(args)[0] in ("parallel_choco", "dpsgd") or (args.lr_scaleup and args.lr_scaleup_factor == "graph"):
        try:  # a bad --graph_topology too, before torch is imported
            check_spec(args.graph_topology)
        except ValueError as e:
            raise SystemExit(f"train_cifar10_choco: {e}")
    train_x, train_y = load_split(args.data_dir, "train")
    test_x, test_y = load_split(args.data_dir, "test")

    bps_gc.core.init()  # the transport the launcher chose (torch only for the collective)
    rank, size = bps_gc.core.rank(), bps_gc.core.size()
    job_notes = check_job(args, parser, size)
    experiment = args.experiment or args.optimizer
    logger = make_logger("cifar10", f"{experiment}.log", rank)
    logger.info(args)
    for note in cluster_notes(args) + job_notes + unused_flag_notes(args, sys.argv[1:] if argv is None else argv):
        logger.info("note: %s", note)
    if args.dry_run:
        try:  # a bad --graph_topology: its message
            dry_run_plan(args, logger, compression(args, parser), peak_lr(args, size), changes, len(train_x) // size,
                         size)
        except ValueError as e:
            raise SystemExit(f"train_cifar10_choco: {e}")
        bps_gc.core.shutdown()
        return
    import_torch()
    device, device_lines = pick_device(requested_device(args, rank))
    for line in device_lines:
        logger.info(line)
    torch.manual_seed(args.manual_seed)
    try:  # a bad --arch, --graph_topology or codec flag: its message, no traceback
        model = resnet(args.arch, classes=CLASSES).to(device)
        peak = peak_lr(args, size)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum_factor,
                              nesterov=args.use_nesterov and args.momentum_factor > 0, weight_decay=args.weight_decay)
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = wrap(args, parser, opt, model, size)
    except ValueError as e:
        raise SystemExit(f"train_cifar10_choco: {e}")
    name, _ = algorithm(args)
    decentralized = name in ("parallel_choco", "dpsgd")
    logger.info("%s on %d workers, peak learning rate %g%s", name, size, peak,
                f", {opt.topology}" if decentralized else "")

    share = len(train_x) // size if args.partition_data == "random" else len(train_x)
    steps = share // args.batch_size if args.max_iters <= 0 else min(share // args.batch_size, args.max_iters)
    if steps == 0:
        raise SystemExit(f"{len(train_x)} images make no batch of {args.batch_size} for each of {size} workers")

    def batches(epoch):
        order_epoch = epoch if args.reshuffle_per_epoch else 0
        if args.partition_data == "random":
            return epoch_batches(args.manual_seed, order_epoch, len(train_x), rank, size, steps, args.batch_size)
        order = np.random.default_rng([args.manual_seed, rank, order_epoch]).permutation(len(train_x))
        return [(epoch, i, order[i * args.batch_size:(i + 1) * args.batch_size]) for i in range(steps)]

    def batch(item):
        epoch, i, indices = item
        rng = np.random.default_rng([args.manual_seed, rank, epoch, i])
        batch = torch.from_numpy(normalize(augment(train_x[indices], rng))), torch.from_numpy(train_y[indices])
        return pinned(batch, device)

    executor = ThreadPoolExecutor(args.num_workers) if args.num_workers > 0 else None
    history, total_steps, done = [], 0, False
    gossip_before, first = 0, 0
    import epoch_checkpoint  # torch: not for a --dry-run
    saved = epoch_checkpoint.resume(args.checkpoint, rank, size, model, opt, summed)
    if saved is not None:
        history, total_steps, gossip_before, first = saved["history"], saved["steps"], saved["gossip"], saved["epoch"] + 1
        logger.info("resumed from %s after epoch %d", args.checkpoint, saved["epoch"])
    try:
        for epoch in range(first, args.num_epochs if args.stop_criteria == "epoch" else 10 ** 9):
            times = {"data": 0.0, "compute": 0.0, "communicate": 0.0}
            correct = seen = 0
            if hasattr(opt, "set_epoch"):
                opt.set_epoch(epoch)
            bps_gc.core.metrics()  # count this epoch's training traffic only
            tic = time.perf_counter()
            for i, (x, y) in enumerate(on_device(prefetch(executor, batch, batches(epoch), max(1, args.num_workers)),
                                                 device)):
                t0 = time.perf_counter()
                times["data"] += t0 - tic
                for group in opt.param_groups:
                    group["lr"] = learning_rate(args, epoch + i / steps, peak, changes)
                opt.zero_grad()
                out = model(x)
                F.cross_entropy(out, y).backward()
                t1 = time.perf_counter()
                opt.step()
                tic = time.perf_counter()
                times["compute"] += t1 - t0
                times["communicate"] += tic - t1
                correct, seen = correct + int((out.argmax(1) == y).sum()), seen + len(y)
                total_steps += 1
                if args.stop_criteria == "iteration" and total_steps >= args.num_iterations:
                    done = True
                    break
            if decentralized:
                opt.finish()
            m = bps_gc.core.metrics()
            gossip = opt.bytes_sent() - gossip_before if decentralized else 0
            gossip_before += gossip
            row = {"epoch": epoch, "steps": i + 1, "server_bytes_per_step": m.pushed_wire / (i + 1),
                   "gossip_bytes_per_step": gossip / (i + 1)}
            c, n = summed([correct, seen], "train.accuracy")
            row["train_accuracy"] = c / n
            logger.info("[Epoch %d] training: accuracy=%f", epoch, row["train_accuracy"])
            logger.info("[Epoch %d] traffic per worker: %.0f bytes/step (to servers %.0f, to neighbours %.0f)",
                        epoch, row["server_bytes_per_step"] + row["gossip_bytes_per_step"],
                        row["server_bytes_per_step"], row["gossip_bytes_per_step"])
            if args.track_time and args.display_tracked_time:
                logger.info("[Epoch %d] time: data %.3f s, forward+backward %.3f s, step+communication %.3f s",
                            epoch, times["data"], times["compute"], times["communicate"])
            last = done or (args.stop_criteria == "epoch" and epoch == args.num_epochs - 1)
            if (epoch + 1) % max(1, args.eval_freq) == 0 or last:
                result = evaluate(model, test_x, test_y, rank, size, decentralized or args.evaluate_avg)
                row.update(test_accuracy=result["workers"], test_accuracy_mean=float(np.mean(result["workers"])))
                logger.info("[Epoch %d] validation: each worker %s, mean accuracy=%f", epoch,
                            " ".join(f"{a:.4f}" for a in result["workers"]), row["test_accuracy_mean"])
                if "average" in result:
                    row["averaged_model_accuracy"] = result["average"]
                    logger.info("[Epoch %d] validation: averaged model accuracy=%f", epoch, result["average"])
            history.append(row)
            if args.checkpoint:
                epoch_checkpoint.save(args.checkpoint, rank, model, opt, epoch, history=history, steps=total_steps,
                                      gossip=gossip_before)
            if last:
                break
        if args.avg_model:
            with torch.no_grad():
                for pname, value in averaged(model).items():
                    dict(model.named_parameters())[pname].copy_(value)
            c, n = summed([accuracy(model, test_x[rank::size], test_y[rank::size]), len(test_y[rank::size])],
                          "final.accuracy")
            logger.info("final: every worker holds the averaged model, accuracy=%f", c / n)
            history.append({"final_averaged_model_accuracy": c / n})
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)
    if rank == 0:
        with open(f"{experiment}.json", "w") as f:
            json.dump({"args": vars(args), "workers": size, "history": history}, f, indent=1)
    bps.shutdown()


if __name__ == "__main__":
    main()
