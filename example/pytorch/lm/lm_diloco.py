"""train.py --api diloco: bps_gc.torch.DiLoCo (docs/diloco.md) over train.py's optimizer as the
inner one, its flags, and the model a DiLoCo run evaluates, the global copy (what
scripts/time_to_accuracy.py --task lm's DiLoCo rows evaluate too: load_global_copy)."""
import argparse
import contextlib

import torch

# flag -> DiLoCo's default (scripts/tta_lm_diloco.py's rows: H = 50, the paper's outer Nesterov SGD)
DEFAULTS = {"sync_every": 50, "fragments": 1, "delay": 0, "alpha": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9,
            "outer_step": None}


def add_diloco_args(p):
    """The flags; absent unless given (check_diloco_args refuses them without --api diloco)."""
    g = p.add_argument_group("DiLoCo (--api diloco; the codec flags compress its pseudo-gradients)")
    g.add_argument("--sync-every", type=int, default=argparse.SUPPRESS, metavar="H",
                   help="inner steps between a fragment's syncs (default 50)")
    g.add_argument("--fragments", type=int, default=argparse.SUPPRESS, metavar="F",
                   help="Streaming DiLoCo: the parameters cut into F fragments, their syncs staggered (default 1)")
    g.add_argument("--delay", type=int, default=argparse.SUPPRESS, metavar="TAU",
                   help="inner steps a fragment's exchange overlaps before its outer step (< H / F; default 0)")
    g.add_argument("--alpha", type=float, default=argparse.SUPPRESS,
                   help="after an outer step, local = alpha local + (1 - alpha) global (default 0)")
    g.add_argument("--outer-lr", type=float, default=argparse.SUPPRESS, help="the outer SGD's rate (default 0.7)")
    g.add_argument("--outer-momentum", type=float, default=argparse.SUPPRESS,
                   help="the outer SGD's momentum, Nesterov (default 0.9; 0: none)")
    g.add_argument("--outer-step", choices=("workers", "servers"), default=argparse.SUPPRESS,
                   help="where the outer step runs: the workers (either transport) or the parameter server's "
                        "servers (bpslaunch --servers N > 0); default: the servers where they can take it (the "
                        "parameter server, a codec their reducer decodes), else the workers")


def check_diloco_args(args, parser):
    """One line (parser.error) for a DiLoCo flag without --api diloco, or a value DiLoCo refuses
    that the flags alone show; fills in DiLoCo's defaults."""
    given = [name for name in DEFAULTS if hasattr(args, name)]
    if args.api != "diloco":
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            parser.error(f"{flags} {'is' if len(given) == 1 else 'are'} --api diloco's (got --api {args.api})")
        return
    for name, value in DEFAULTS.items():
        setattr(args, name, getattr(args, name, value))
    if args.sync_every < 1:
        parser.error(f"--sync-every must be >= 1, got {args.sync_every}")
    if not 1 <= args.fragments <= args.sync_every:
        parser.error(f"--fragments must be between 1 and --sync-every ({args.sync_every}), got {args.fragments}")
    if not 0 <= args.delay < args.sync_every / args.fragments:
        parser.error(f"--delay must be >= 0 and below --sync-every / --fragments ({args.sync_every} / "
                     f"{args.fragments}), got {args.delay}")
    if not 0.0 <= args.alpha < 1.0:
        parser.error(f"--alpha must be in [0, 1), got {args.alpha}")
    if args.outer_lr <= 0 or not 0.0 <= args.outer_momentum < 1.0:
        parser.error(f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got {args.outer_lr} and "
                     f"{args.outer_momentum}")
    if args.compress_momentum:
        parser.error("--compress-momentum moves the optimizer's momentum into the codec chain: not with --api "
                     "diloco, whose codec compresses the pseudo-gradients")


def make_diloco(bps, args, model, inner, params, replicate=None):
    """bps_gc.torch.DiLoCo over ``inner`` with the flags' settings and ``params`` as the
    pseudo-gradients' codec, averaged over ``replicate`` (a sharded model's replicate group;
    None: every rank); what DiLoCo refuses ends the script on its one line."""
    momentum = args.outer_momentum

    def outer(copies):
        return torch.optim.SGD(copies, lr=args.outer_lr, momentum=momentum, nesterov=momentum > 0)
    try:
        opt = bps.DiLoCo(model, inner, args.sync_every, outer_optimizer=outer, fragments=args.fragments,
                         delay=args.delay, alpha=args.alpha, compression_params=params, outer_step=args.outer_step,
                         replicate=replicate)
    except ValueError as e:
        raise SystemExit(f"train.py: {e}")
    args.outer_step = opt.outer_step  # where DiLoCo's default put it, for describe()
    return opt


def describe(args):
    """The model line's words on the DiLoCo."""
    momentum = f"momentum {args.outer_momentum}{' nesterov' if args.outer_momentum > 0 else ''}"
    return (f" (H={args.sync_every}, {args.fragments} fragment{'s' if args.fragments > 1 else ''}, delay "
            f"{args.delay}, alpha {args.alpha}, outer SGD lr {args.outer_lr} {momentum} on the {args.outer_step})")


@contextlib.contextmanager
@torch.no_grad()
def global_copy_in_shards(opt, model):
    """A model sharded with FSDP2 (``--shards``) holding ``opt``'s global copy for the block:
    each rank's local shards are swapped for their global copies, then back. Every rank of a
    shard group enters together (the forward gathers the shards). FSDP2 keeps the root's gathered
    parameters after a forward without backward: resharding drops them, so that neither the
    evaluation nor the next training step sees the other's values."""
    from torch.distributed.fsdp import FSDPModule
    pairs = [(p.to_local(), copy) for f in opt.fragments for (_, p), copy in zip(f.named, f.copies)]
    kept = [shard.clone() for shard, _ in pairs]
    reshard = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in reshard:
        m.reshard()
    for shard, copy in pairs:
        shard.copy_(copy)
    try:
        yield model
    finally:
        for m in reshard:
            m.reshard()
        for (shard, _), value in zip(pairs, kept):
            shard.copy_(value)


@torch.no_grad()
def load_global_copy(opt, model):
    """``model`` (a copy of the replica's, with its own tensors) set to ``opt``'s global copy:
    each fragment's as of its last applied outer step (an exchange in flight not included)."""
    for fragment in opt.fragments:
        for (name, _), global_copy in zip(fragment.named, fragment.copies):
            model.get_parameter(name).copy_(global_copy)
    return model
