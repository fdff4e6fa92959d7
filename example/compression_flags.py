"""BytePS's gradient compression flags for training scripts (framework-free): add them to an
argparse parser, then turn the parsed flags into ``compression_params`` for
``bps_gc.torch.DistributedOptimizer`` or ``bps_gc.mxnet.DistributedTrainer``."""
from bps_gc.compress import CompressionParams


def add_compression_args(parser):
    """--compressor --ef --compress-momentum --onebit-scaling --k --fp16-pushpull as in BytePS's
    scripts, plus --seed (the codec seed, also the script's own) and the dithering options."""
    group = parser.add_argument_group("gradient compression")
    group.add_argument("--compressor", type=str, default="",
                       help="onebit, topk, randomk, dithering (or a plugin's); empty: none")
    group.add_argument("--ef", type=str, default="", help="error feedback: vanilla")
    group.add_argument("--compress-momentum", type=str, default="",
                       help="nesterov: the optimizer's momentum moves into the codec chain")
    group.add_argument("--onebit-scaling", action="store_true", default=False,
                       help="scale onebit's signs by the mean magnitude")
    group.add_argument("--k", type=float, default=1.0,
                       help="topk/randomk: a fraction (< 1) or a count (>= 1) per partition; "
                            "dithering: the number of levels")
    group.add_argument("--fp16-pushpull", action="store_true", default=False,
                       help="push and pull the gradients as float16")
    group.add_argument("--seed", type=int, default=2020,
                       help="random seed: randomk/dithering's codec seed (must be > 0 for them), "
                            "data shuffling and augmentation, initialization")
    group.add_argument("--partition", type=str, default="linear", choices=("linear", "natural"),
                       help="dithering: linear or natural partition of the levels")
    group.add_argument("--normalize", type=str, default="max", choices=("max", "l2"),
                       help="dithering: normalize by the max or the l2 norm")
    return group


def compression_params(args, parser):
    """The ``compression_params`` the flags ask for, None for none. A bad combination stops the
    script through ``parser.error`` here, before it joins the cluster. With --compress-momentum
    the script's ``args.momentum`` must be > 0 (the binding takes mu from the optimizer)."""
    params = {}
    if args.compressor:
        params["compressor"] = args.compressor
        if args.ef:
            params["ef"] = args.ef
        if args.compress_momentum:
            if not getattr(args, "momentum", 0):
                parser.error("--compress-momentum moves the optimizer's momentum into the codec "
                             "chain and needs --momentum > 0")
            params["momentum"] = args.compress_momentum
        if args.onebit_scaling:
            params["scaling"] = True
        if args.compressor != "onebit":  # topk, randomk, dithering (and plugins) take k
            params["k"] = args.k
        if args.compressor in ("randomk", "dithering"):
            if args.seed <= 0:
                parser.error(f"--seed must be > 0 for {args.compressor}, got {args.seed}")
            params["seed"] = args.seed
        if args.compressor == "dithering":
            params["partition"] = args.partition
            params["normalize"] = args.normalize
    elif args.ef or args.compress_momentum or args.onebit_scaling:
        parser.error("--ef, --compress-momentum and --onebit-scaling need --compressor")
    if args.fp16_pushpull:
        params["fp16"] = True
    if not params:
        return None
    try:
        CompressionParams.from_dict(dict(params, **({"mu": args.momentum} if "momentum" in params else {})))
    except ValueError as e:
        parser.error(str(e))
    return params
