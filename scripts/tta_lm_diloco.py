"""The DiLoCo rows of scripts/time_to_accuracy.py --task lm (bps_gc.torch.DiLoCo on
torch.distributed, issue 44): their settings, names and flags.

    --diloco-every H                      inner steps between a fragment's syncs (>= 8: F=4, tau=1)
    --diloco-warm-steps W --diloco-warm-every H0
                                          a warm phase first: plain averaging every H0 steps for
                                          W steps (DiLoCo's warm_steps, warm_every; docs/diloco.md)
    --diloco-outer-lr LR                  the outer Nesterov SGD's lr (default the paper's 0.7)

The warm phase and the outer lr are bps_gc's rows' only (torchft's DiLoCo has no warm phase and
keeps the paper's outer step); their names say them. The F=4 tau=1 rows run bps_gc's phase (a
fragment's exchange starts after inner step (f + 1) H // 4 mod H, its outer step tau later);
"F=4 tau=1 dense (torchft's phase)" is the dense one on torchft's schedule (each tau steps sooner).
"""
THC = {"compressor": "thc", "bits": 4, "feedback": True}  # error feedback across outer steps
# the name after "bps_gc DiLoCo H=<H> " -> (fragments, delay tau, compression_params)
# (F=4 tau=1 dense: the pair of torchft's F=4 row, which has no thc: scripts/tta_lm_torchft.py)
DILOCO = {"dense": (1, 0, None), "thc 4-bit": (1, 0, THC), "F=4 tau=1 dense": (4, 1, None),
          "F=4 tau=1 thc 4-bit": (4, 1, THC)}
# F=4 tau=1 dense again, its step counter started at tau (as a checkpoint's would be: scripts/
# diloco_vs_torchft.py's "(torchft's phase)" cases): every start and outer step on torchft's steps
TORCHFT_PHASE = ("F=4 tau=1 dense (torchft's phase)", (4, 1, None, "torchft's phase"))
OUTER_LR = 0.7  # the paper's (and bps_gc.torch.DiLoCo's default outer SGD's), momentum 0.9, Nesterov
MAX_DELAY = max(delay for _, delay, _ in DILOCO.values())  # a warm exchange is applied this late


def add_diloco_args(g):
    g.add_argument("--diloco-every", type=int, default=50, metavar="H",
                   help="lm: the DiLoCo rows' inner steps between a fragment's syncs (>= 8: F=4, tau=1)")
    g.add_argument("--diloco-warm-steps", type=int, default=0, metavar="W",
                   help="lm: bps_gc's DiLoCo rows start with a warm phase of W steps of plain averaging (0: none)")
    g.add_argument("--diloco-warm-every", type=int, default=None, metavar="H0",
                   help="lm: the warm phase's inner steps between averages (divides W; >= 2, above the "
                        "F=4 tau=1 row's delay)")
    g.add_argument("--diloco-outer-lr", type=float, default=OUTER_LR, metavar="LR",
                   help="lm: bps_gc's DiLoCo rows' outer Nesterov SGD lr (momentum 0.9; default the paper's 0.7)")


def check_diloco_args(args, p):
    """One line (p.error) for DiLoCo flags the rows would refuse mid-run."""
    every, warm, warm_every = args.diloco_every, args.diloco_warm_steps, args.diloco_warm_every
    if not args.diloco_outer_lr > 0:
        p.error(f"--diloco-outer-lr must be > 0, got {args.diloco_outer_lr}")
    if every < 8:
        p.error(f"--diloco-every must be >= 8 (the F=4 tau=1 row's delay 1 must be below H / 4), got {every}")
    if warm < 0:
        p.error(f"--diloco-warm-steps must be >= 0, got {warm}")
    if not warm and warm_every is not None:
        p.error(f"--diloco-warm-every {warm_every} needs --diloco-warm-steps W > 0 (the warm phase's length)")
    if warm and (warm_every is None or warm_every <= MAX_DELAY or warm % warm_every):
        p.error(f"--diloco-warm-every must divide --diloco-warm-steps ({warm}) and be above the F=4 tau=1 row's "
                f"delay {MAX_DELAY}, got {warm_every}")


def diloco_rows(args):
    """{row name: (fragments, delay, compression_params)} at H = --diloco-every."""
    warm = f" warm {args.diloco_warm_steps}/{args.diloco_warm_every}" if args.diloco_warm_steps else ""
    warm += f" outer lr {args.diloco_outer_lr:g}" if args.diloco_outer_lr != OUTER_LR else ""
    rows = {**DILOCO, TORCHFT_PHASE[0]: TORCHFT_PHASE[1]}
    return {f"bps_gc DiLoCo H={args.diloco_every}{warm} {name}": settings for name, settings in rows.items()}


def make_diloco(bps, model, opt, args, settings, replicate=None):
    """bps_gc.torch.DiLoCo over ``opt`` with a row's (fragments, delay, compression_params[,
    torchft's phase]), its replicas every rank, or ``replicate``'s (a process group: the HSDP rows')."""
    import torch
    fragments, delay, compression, *phase = settings
    warm = {"warm_steps": args.diloco_warm_steps, "warm_every": args.diloco_warm_every} if args.diloco_warm_steps else {}
    lr = args.diloco_outer_lr
    outer = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True)  # noqa: E731
    diloco = bps.DiLoCo(model, opt, args.diloco_every, outer_optimizer=outer, fragments=fragments, delay=delay,
                        compression_params=compression, replicate=replicate, **warm)
    if phase:  # as if resumed tau steps in: each exchange starts tau steps sooner, its outer step on torchft's
        saved = diloco.state_dict()
        saved["steps"] = delay
        diloco.load_state_dict(saved)
    return diloco
