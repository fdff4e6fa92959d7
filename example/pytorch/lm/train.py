#!/usr/bin/env python3
"""A small GPT on the Python standard library's source (bytes), data-parallel with bps_gc's
gradient compression: the transformer yardstick of scripts/time_to_accuracy.py --task lm.

    torchrun --nproc-per-node 2 example/pytorch/lm/train.py --steps 300
    torchrun --nproc-per-node 2 example/pytorch/lm/train.py --compressor topk --k 0.01 --ef vanilla
    torchrun --nproc-per-node 2 example/pytorch/lm/train.py --api optimizer --compressor thc --bits 4 --ef vanilla
    torchrun --nproc-per-node 4 example/pytorch/lm/train.py --api fsdp --shards 2                # native HSDP
    torchrun --nproc-per-node 4 example/pytorch/lm/train.py --api fsdp --shards 2 --compressor powersgd --rank 4
    torchrun --nproc-per-node 2 example/pytorch/lm/train.py --api diloco --sync-every 50 --compressor thc --bits 4 --ef vanilla
    torchrun --nproc-per-node 4 example/pytorch/lm/train.py --api diloco --shards 2 --compressor thc --bits 4 --ef vanilla
    bpslaunch --local --workers 2 --servers 1 -- python example/pytorch/lm/train.py --api diloco --sync-every 50 \\
        --fragments 4 --delay 1 --compressor onebit --onebit-scaling --ef vanilla
    bpslaunch --local --workers 2 --servers 1 -- python example/pytorch/lm/train.py --api optimizer \\
        --optimizer sgd --lr 0.3 --compressor onebit --onebit-scaling --ef vanilla --compress-momentum nesterov

``--api hook`` (default) is an ordinary DDP script with ``bps.comm_hook`` registered (dense DDP
without --compressor); it needs torch.distributed (torchrun, or bpslaunch --servers 0).
``--api optimizer`` wraps the optimizer in ``bps.DistributedOptimizer`` on either transport.
``--api fsdp`` shards the model with FSDP2 on a (ranks / --shards, --shards) mesh (hsdp.py; on
torch.distributed): native HSDP without --compressor, else each block sharded on mesh["shard"]
and ``bps.register_fsdp_hooks`` compressing the gradient shards across the replicas (--hsdp
hooks without --compressor: the dense hooks).
``--api diloco`` communicates rarely: ``bps.DiLoCo`` (docs/diloco.md) takes --sync-every H
inner steps with the optimizer below on each rank alone, then averages the pseudo-gradients
(global copy - local parameters) through the job's transport, compressed by the codec flags,
and takes the outer step (Nesterov SGD, --outer-lr 0.7 --outer-momentum 0.9: the paper's) on
the global copy; --fragments F and --delay tau are Streaming DiLoCo's (lm_diloco.py). On
either transport; on the parameter server the servers take it by default (--outer-step).
With --shards S (torch.distributed) each replica is S ranks sharding the model with FSDP2 on
mesh["shard"] (their reduce-scatter averages the inner gradients), and DiLoCo averages each
shard over mesh["replicate"] (docs/diloco.md "A sharded model inside each replica"). Each
rank clips its own gradients; the global copy is evaluated, and bytes are per inner step.
The model (gpt.py) and the data and its split (stdlib_text.py) are in this folder. AdamW by
default (SGD for the codec recipes that move the momentum into the chain), a linear warm-up
and a cosine decay to a tenth of --lr, gradients clipped to --clip after they are averaged.
--precision auto trains under bf16 autocast where the device computes bf16 natively (a CPU
with AVX-512 BF16 or AMX too) and says so at the start; the attention is then the formulation
that is faster there (gpt.attention_for).
Every --eval-every steps rank 0 prints the validation loss (nats per byte), bits per byte and
tokens per second of training (all ranks, evaluation excluded); its last line is
``final: val_loss=<float> bpb=<float> tokens_per_s=<float>``; where bps_gc carried the
gradients, an ``exchange: <int> bytes per step ...`` line before it says how much (rank 0's
bps.metrics(): what it handed the exchange; DiLoCo's: ``exchange: <float> bytes per inner step
... (bps.metrics(): <int> bytes in <int> inner steps)``). With --checkpoint DIR every rank
saves model, optimizer and bps.state_dict() after each evaluation, and a run with the same
DIR resumes there, bit for bit.
"""
import argparse
import contextlib
import copy
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
import bps_gc.torch as bps  # noqa: E402
import epoch_checkpoint  # noqa: E402
from compression_flags import add_compression_args, compression_params  # noqa: E402
from gpt import attention_for, byte_loss, parameter_count  # noqa: E402
from lm_diloco import (add_diloco_args, check_diloco_args, describe, global_copy_in_shards, load_global_copy,  # noqa: E402
                       make_diloco)
from lm_training import (add_model_args, add_optimizer_args, build_model, check_args, clipped_step, evaluate,  # noqa: E402
                         lr_at, make_optimizer)
from stdlib_text import Corpus, train_batch, unigram_entropy_bits, val_windows  # noqa: E402
from study_flags import OneLineParser, require_launcher  # noqa: E402
from study_training import distribute, summed  # noqa: E402
from torch_device import PRECISION_HELP, MixedPrecision, add_device_arg, pick_device, pick_precision  # noqa: E402


def build_parser():
    p = OneLineParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--api", choices=("hook", "optimizer", "fsdp", "diloco"), default="hook")
    p.add_argument("--shards", type=int, default=None, help="--api fsdp, --api diloco: ranks a model is sharded "
                                                           "over with FSDP2 (one host's; --api fsdp's default: "
                                                           "LOCAL_WORLD_SIZE; --api diloco's: none, unsharded)")
    p.add_argument("--hsdp", choices=("native", "hooks"), default=None,
                   help="--api fsdp across the replicas: native HSDP (default without --compressor) or "
                        "register_fsdp_hooks (default with one)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto", help=PRECISION_HELP)
    p.add_argument("--checkpoint", default="", help="a folder: each rank saves there after each evaluation; "
                                                    "a run with the same folder resumes")
    add_model_args(p)
    add_optimizer_args(p)
    add_diloco_args(p)
    add_device_arg(p)
    g = add_compression_args(p)
    g.add_argument("--bits", type=int, default=4, help="thc: bits per coordinate")
    g.add_argument("--rank", type=int, default=4, help="powersgd: the approximation's rank")
    return p


def codec_params(args, parser):
    """compression_flags' params; thc takes --bits, and --ef as its own error feedback; powersgd
    --rank (and keeps its own error feedback)."""
    thc_feedback = args.compressor == "thc" and args.ef
    if thc_feedback:  # thc's feedback is its own option: the generic check would refuse 'ef'
        if args.ef != "vanilla":
            parser.error(f"--ef {args.ef}: thc takes --ef vanilla (its own error feedback) or none")
        args = argparse.Namespace(**dict(vars(args), ef=""))
    params = compression_params(args, parser)
    if params and params["compressor"] == "powersgd":
        params.pop("k", None)
        params["rank"] = args.rank
    if params and params["compressor"] == "thc":
        params.pop("k", None)
        params.update(bits=args.bits, **({"feedback": True} if thc_feedback else {}))
    return params


def check_fsdp_args(args, parser):
    if args.api == "diloco" and args.shards is not None:  # DiLoCo across the replicas, FSDP2 inside each
        if args.hsdp is not None:
            parser.error("--hsdp is --api fsdp's: with --api diloco --shards nothing crosses the replicas between syncs")
        if args.shards < 1:
            parser.error(f"--shards must be >= 1, got {args.shards}")
        if args.checkpoint:
            parser.error("--checkpoint is not supported with --shards (its parameters are sharded DTensors)")
        return
    if args.api != "fsdp":
        if args.hsdp is not None:
            parser.error(f"--hsdp is --api fsdp's (got --api {args.api})")
        if args.shards is not None:
            parser.error(f"--shards is --api fsdp's and --api diloco's (got --api {args.api})")
        return
    if args.checkpoint:
        parser.error("--checkpoint is not supported with --api fsdp (its parameters are sharded DTensors)")
    if args.shards is None:
        args.shards = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.shards < 1:
        parser.error(f"--shards must be >= 1, got {args.shards}")
    args.hsdp = args.hsdp or ("hooks" if args.compressor else "native")
    if args.hsdp == "native" and args.compressor:
        parser.error("--hsdp native all-reduces dense: drop --compressor, or use --hsdp hooks")


def shard(args, model, device, params):
    """Shard ``model`` on the (replicas, --shards) mesh (--api diloco: on mesh["shard"] alone);
    its description for the model line, and the mesh."""
    from hsdp import mesh_for, shard_gpt
    try:
        mesh = mesh_for(args.shards, device.type)
    except ValueError as e:
        sys.exit(f"train.py: {e}")
    shard_gpt(model, mesh, "none" if args.api == "diloco" else args.hsdp, params)
    if args.api == "diloco":
        return f"; FSDP2 inside each replica, the (replicas, shards) mesh {tuple(mesh.shape)}", mesh
    return f" ({args.hsdp} HSDP on the (replicas, shards) mesh {tuple(mesh.shape)})", mesh


def evaluated_loss(evaluated, val, device, amp):
    with evaluated() as model:
        return evaluate(model, val, device, amp)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    check_fsdp_args(args, parser)
    check_diloco_args(args, parser)
    params = codec_params(args, parser)
    corpus = Corpus(args.corpus).check(args.context, args.val_windows)
    require_launcher("example/pytorch/lm/train.py")
    device, device_lines = pick_device(args.device)
    bps.init()
    if (args.api in ("hook", "fsdp") or args.shards) and not dist.is_initialized():
        what = "--api diloco --shards" if args.api == "diloco" else f"--api {args.api}"
        sys.exit(f"{what} needs torch.distributed: start with torchrun or 'bpslaunch --servers 0', "
                 "or use --api optimizer")
    rank, size = bps.rank(), bps.size()
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype, precision_line = pick_precision(args.precision, device)
    amp = MixedPrecision(device, dtype)
    attention = attention_for(device.type, dtype)
    model = build_model(args, device, attention)
    if args.api == "diloco":  # every replica starts from rank 0's parameters (before any is a shard)
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
    sharded, replicate = "", None
    if args.shards:  # the optimizer is made over the sharded (DTensor) parameters
        sharded, mesh = shard(args, model, device, params)
        replicate = mesh["replicate"].get_group() if args.api == "diloco" else None
    opt = make_optimizer(args, model)
    if args.api == "fsdp":
        net = model
    elif args.api == "diloco":
        net, opt = model, make_diloco(bps, args, model, opt, params, replicate)
        # the global copy is evaluated: in a model of its own, or swapped into the shards
        deployed = None if replicate else copy.deepcopy(model)
    elif args.api == "hook":
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # broadcasts rank 0's
        if params:
            net.register_comm_hook(None, bps.comm_hook(params, optimizer=opt,
                                                       named_parameters=model.named_parameters()))
    else:
        net, opt = model, distribute(opt, model, params, "train.py")
    say("\n".join(device_lines + [precision_line]))
    say(f"model: {parameter_count(model):,} parameters ({args.layers} layers, width {args.width}, {args.heads} heads, "
        f"context {args.context}, attention {attention}); {amp.describe()}; {size} ranks x batch {args.batch_size}; "
        f"api {args.api}{sharded if args.api == 'fsdp' else describe(args) + sharded if args.api == 'diloco' else ''}, "
        f"{args.optimizer}, compression {params or 'none'}")
    say(f"corpus: {corpus.describe()}")
    unigram = unigram_entropy_bits(corpus.train, corpus.val)
    say(f"unigram entropy: {unigram:.4f} bits per byte (the validation bytes under the training bytes' frequencies)")
    val = val_windows(corpus.val, args.val_windows, args.context)
    # DistributedOptimizer's state_dict() carries its codec state; the hook's and DiLoCo's go beside
    hook_state, diloco = args.api in ("hook", "diloco"), args.api == "diloco"
    if not diloco:
        evaluated = lambda: contextlib.nullcontext(model)  # noqa: E731
    elif replicate:  # sharded: the global copy swapped into the shards for the evaluation
        evaluated = lambda: global_copy_in_shards(opt, model)  # noqa: E731
    else:
        evaluated = lambda: contextlib.nullcontext(load_global_copy(opt, deployed))  # noqa: E731
    saved = epoch_checkpoint.resume(args.checkpoint, rank, size, model, opt, summed)
    first, train_seconds = 0, 0.0
    if saved is not None:
        first, train_seconds = saved["epoch"], saved["train_seconds"]
        if hook_state:
            bps.load_state_dict(saved["bps_gc"])
        if diloco:  # no push reaches a server before every worker restored its state
            bps.barrier()
        say(f"resumed from {args.checkpoint} at step {first}")
    tokens_per_step = args.batch_size * args.context * size
    val_loss = evaluated_loss(evaluated, val, device, amp) if first == 0 else saved["val_loss"]
    bps.metrics()  # reset: what bps_gc carries from here is the training's exchange
    for step in range(first, args.steps):
        began = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        x, y = (torch.from_numpy(a).to(device) for a in
                train_batch(corpus.train, args.seed, rank, step, args.batch_size, args.context))
        opt.zero_grad()
        with amp.autocast():
            loss = byte_loss(net(x), y)  # through DDP's forward, so that its hooks see the backward
        loss.backward()
        clipped_step(opt, model, args.clip, synchronizes=args.api == "optimizer")
        train_seconds += time.perf_counter() - began
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            if diloco:  # no exchange in flight beside the checkpoint's barrier (its average kept for its step)
                opt.wait()
            val_loss = evaluated_loss(evaluated, val, device, amp)
            say(f"step {done}: train_loss={loss.item():.4f} val_loss={val_loss:.4f} bpb={val_loss / math.log(2):.4f} "
                f"tokens_per_s={done * tokens_per_step / max(train_seconds, 1e-9):.0f}", flush=True)
            if args.checkpoint:
                epoch_checkpoint.save(args.checkpoint, rank, model, opt, done, train_seconds=train_seconds,
                                      val_loss=val_loss, **({"bps_gc": bps.state_dict()} if hook_state else {}))
                bps.barrier()
    pushed, steps = bps.metrics().pushed_wire, max(args.steps - first, 1)
    if pushed and diloco:
        say(f"exchange: {pushed / steps:.1f} bytes per inner step handed bps_gc's exchange by rank 0 "
            f"(bps.metrics(): {pushed} bytes in {steps} inner steps)")
    elif pushed:  # bps_gc carried the gradients (not dense DDP, nor native HSDP)
        say(f"exchange: {pushed / steps:.0f} bytes per step handed bps_gc's exchange by rank 0 (bps.metrics())")
    bpb = val_loss / math.log(2)
    say(f"bits per byte {bpb:.4f}: {100 * (1 - bpb / unigram):.1f}% below the unigram entropy")
    say(f"final: val_loss={val_loss:.6f} bpb={val_loss / math.log(2):.6f} "
        f"tokens_per_s={args.steps * tokens_per_step / max(train_seconds, 1e-9):.1f}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
