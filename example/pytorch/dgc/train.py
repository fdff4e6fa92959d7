#!/usr/bin/env python3
"""DGC's way of running (Lin et al., ICLR 2018; their train.py with horovodrun or mpirun) on
bps_gc: the same config files and flags, torchrun or bpslaunch in front instead.

    torchrun --nproc-per-node 8 example/pytorch/dgc/train.py --configs configs/cifar/resnet20.py \\
        configs/dgc/wm5.py configs/dgc/fp16.py configs/dgc/int32.py
    bpslaunch --local --workers 8 --servers 1 -- python example/pytorch/dgc/train.py --configs ...
    python example/pytorch/dgc/train.py --configs ... --configs.train.num_epochs 500 --suffix .e500 --dry-run

--configs FILE...     config files, later ones overriding earlier ones (dgc_config.py); a
                      relative path is looked up in the working directory, then next to this script
--configs.a.b VALUE   replace one setting (a Python literal, or text)
--suffix S            appended to the run folder's name
--dry-run             print the resolved settings as one JSON object (last line) and exit 0
--evaluate            evaluate the best checkpoint and exit
--devices gpu|cpu     DGC's flag: gpu trains on cuda:LOCAL_RANK (a note and the CPU where there is
                      no GPU), cpu on the CPU; unset: configs.device (auto: the GPU if any)
--device D            auto, cpu, cuda or cuda:N; replaces --devices and configs.device
--configs.train.mixed_precision float16|bfloat16
                      autocast (float16 with a gradient scaler), bps_gc's setting; DGC's
                      configs/dgc/fp16.py is float16 values on the wire, float32 training

The run folder is runs/<name from the config files><suffix>.np<workers> in the working
directory; each worker keeps checkpoints/e<epoch>-r<rank>.pth (the last train.keep_checkpoints
epochs), latest-r<rank>.pth and best-r<rank>.pth (written atomically), and a run with the same
folder resumes from latest, DGC's memory included (the optimizer's state_dict holds it). Rank 0 logs each epoch's loss, test top-1/top-5 accuracy and traffic to stdout and
train.log, and appends the numbers to metrics.jsonl.

How DGC's settings map onto bps_gc (the resolved JSON's "bps_gc" entry lists the codec
parameters and every note): the `dgc` codec with `k` = compress_ratio, warm-up densities
(warmup_coeff; without a list DGC's own r^((e+1)/(W+1))), `fp16_values`, `clip_norm` =
memory.gradient_clipping, `momentum_masking`, and the optimizer's momentum moved into its
momentum correction, plain or nesterov as memory.nesterov says; weight decay stays local (docs/codecs.md "DGC in the bindings").
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from dgc_config import ConfigError, Config, configs, load, override, reset, run_name  # noqa: E402
from dgc_settings import bps_gc_settings, checked, env_workers  # noqa: E402
from study_flags import OneLineParser, require_launcher  # noqa: E402
from torch_device import DEVICE_HELP, parse_device  # noqa: E402

SCRIPT = "example/pytorch/dgc/train.py"


def build_parser():
    p = OneLineParser(prog=SCRIPT, description="DGC's train.py on bps_gc, under torchrun or bpslaunch.",
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="Any setting of the config files can be replaced: --configs.a.b VALUE (a Python "
                             "literal or text), e.g. --configs.train.num_epochs 500. The run folder is "
                             "runs/<config names><suffix>.np<workers>; running again resumes from its latest "
                             "checkpoint. docs/seeds.md lists how DGC's settings map onto bps_gc.")
    p.add_argument("--configs", nargs="+", required=True, metavar="FILE",
                   help="config files, later ones overriding earlier ones (e.g. configs/cifar/resnet20.py "
                        "configs/dgc/wm5.py)")
    p.add_argument("--suffix", default="", help="appended to the run folder's name")
    p.add_argument("--dry-run", action="store_true", help="print the resolved settings as JSON and exit")
    p.add_argument("--evaluate", action="store_true", help="evaluate the best checkpoint and exit")
    p.add_argument("--devices", default=None, choices=["gpu", "cpu"],
                   help="DGC's device flag: gpu trains on cuda:LOCAL_RANK (no GPU here: a note and the CPU), cpu "
                        "on the CPU; unset: configs.device (auto)")
    p.add_argument("--device", type=parse_device, default=None, help=DEVICE_HELP + "; replaces --devices")
    return p


def split_argv(argv):
    """(the script's own flags, [(key, text)] of --configs.a.b VALUE)."""
    own, overrides, i = [], [], 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("--configs."):
            key = word[len("--configs."):]
            if "=" in key:
                overrides.append(tuple(key.split("=", 1)))
                i += 1
                continue
            if i + 1 >= len(argv):
                raise ConfigError(f"{word}: needs a value")
            overrides.append((key, argv[i + 1]))
            i += 2
            continue
        own.append(word)
        i += 1
    return own, overrides


def set_run_paths(c, name, suffix, workers):
    c.train.save_path = os.path.join("runs", f"{name}{suffix}.np{workers}")
    folder = os.path.join(c.train.save_path, "checkpoints")
    c.train.checkpoint_path = os.path.join(folder, "e{epoch}-r{rank}.pth")
    c.train.latest_pth_path = os.path.join(folder, "latest-r{rank}.pth")
    c.train.best_pth_path = os.path.join(folder, "best-r{rank}.pth")


def resolve(args, overrides, workers):
    """The settings of the config files and overrides, checked, with the run's paths and the
    bps_gc translation (c.bps_gc). Raises ConfigError."""
    reset()
    load(args.configs, search=[HERE])
    for key, text in overrides:
        override(key, text)
    checked(configs)
    set_run_paths(configs, run_name(args.configs), args.suffix, workers)
    configs.bps_gc = Config(bps_gc_settings(configs, workers))
    if args.device or args.devices:
        configs.device = args.device or {"gpu": "cuda", "cpu": "cpu"}[args.devices]
    try:
        configs.device = parse_device(configs.device)
    except Exception as e:
        raise ConfigError(f"configs.device: {e}") from None
    if configs.train.get("mixed_precision") not in (None, "float16", "bfloat16"):
        raise ConfigError(f"configs.train.mixed_precision: None, float16 or bfloat16, got "
                          f"{configs.train.mixed_precision!r}")
    return configs


def main(argv=None):
    parser = build_parser()
    try:
        own, overrides = split_argv(sys.argv[1:] if argv is None else list(argv))
        args = parser.parse_args(own)
        c = resolve(args, overrides, env_workers())
    except ConfigError as e:
        parser.error(str(e))
    if args.dry_run:
        print(json.dumps(c.to_plain(), sort_keys=True))
        return 0
    require_launcher(SCRIPT)
    from dgc_training import run  # torch and bps_gc.torch only for a real run
    return run(c, args, lambda workers: set_run_paths(c, run_name(args.configs), args.suffix, workers))


if __name__ == "__main__":
    sys.exit(main())
