"""The compression flags of the layer-wise vs entire-model study's scripts (Dutta et al., AAAI
2020: train_cifar10_resnet9.py, training/train_imagenet_nv.py) and of DGC's (Lin et al., ICLR
2018), and the bps_gc ``compression_params`` each combination means (algorithms.md sections 2-3).

    --compress layerwise|entiremodel|none   one codec per tensor, or once over the whole model
    --method topk|randomk|thresholdv|terngrad|qsgd|none   (any case: the seed writes Topk)
    --ratio K      kept fraction for topk/randomk (as in the seed and DGC; not local SGD's
                   dropped fraction: see the ratio trap in algorithms.md)
    --threshold V  thresholdv keeps |g| >= V
    --qstates Q    qsgd's levels
    --momentum M   the optimizer's momentum (the study: 0, plain SGD)
    --compressor dgc --k 0.001 --warmup-epochs 5 --fp16-values   DGC

As in the study there is no error feedback. A flag combination that does not make sense stops
the script through ``parser.error`` (one line, no traceback) before it joins the cluster.

Reduction: entire-model and DGC pull the exact sum of the workers' messages (the study's and
DGC's allgather); layer-wise tensors use their codec's default reducer, BytePS's recompress (the
server compresses the sum again), which the study did not do.
"""
import argparse
import os
import sys

from bps_gc.compress import CompressionParams, ParamError

# the seed's method name (lower case) -> bps_gc compressor
METHODS = {"topk": "topk", "randomk": "randomk", "thresholdv": "threshold", "terngrad": "terngrad",
           "qsgd": "qsgd", "none": None}
GRANULARITIES = ("layerwise", "entiremodel", "none")


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line naming it (no usage block, no traceback); --help has the rest."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def lower(value):
    return value.strip().lower()


def add_study_args(parser, momentum=0.0):
    """The study's and DGC's flags (both seeds' spellings and short forms)."""
    g = parser.add_argument_group("gradient compression (the layer-wise study's and DGC's flags)")
    g.add_argument("--compress", "-c", type=lower, default="none", choices=GRANULARITIES,
                   help="layerwise: the codec runs on each tensor; entiremodel: once over all gradients of a "
                        "step as one vector (one global top-k, norm, max or threshold); none: dense")
    g.add_argument("--method", type=lower, default="none", choices=sorted(METHODS),
                   help="the study's codec, in any case (Topk = topk): topk / randomk keep --ratio of the "
                        "elements, thresholdv keeps |g| >= --threshold, terngrad (no parameter), qsgd with "
                        "--qstates levels")
    g.add_argument("--ratio", "-K", type=float, default=0.5,
                   help="topk/randomk: the fraction of elements KEPT, in (0, 1) (the study's and DGC's meaning)")
    g.add_argument("--threshold", "-V", type=float, default=0.001, help="thresholdv: keep |g| >= V")
    g.add_argument("--qstates", "-Q", type=int, default=255, help="qsgd: the number of levels Q")
    g.add_argument("--momentum", type=float, default=momentum,
                   help="SGD momentum, applied after aggregation (DGC: moved into its momentum correction)")
    g.add_argument("--compressor", type=lower, default="",
                   help="dgc: Deep Gradient Compression (instead of --method)")
    g.add_argument("--k", type=float, default=0.001, help="dgc: the final kept fraction")
    g.add_argument("--warmup-epochs", type=int, default=0,
                   help="dgc: sparsity warm-up epochs W (epoch e < W keeps k^((e+1)/W))")
    g.add_argument("--fp16-values", action="store_true", help="dgc: send the kept values as float16")
    g.add_argument("--nesterov", action="store_true",
                   help="nesterov momentum (DGC: nesterov momentum correction)")
    g.add_argument("--min-compress-bytes", type=int, default=None,
                   help="tensors smaller than this go dense (default 0: the study compresses every layer; "
                        "BytePS's 65536 is BYTEPS_MIN_COMPRESS_BYTES's default)")
    parser.add_argument("--checkpoint", default="",
                        help="a folder: each rank saves its state there after every epoch (model, optimizer, "
                             "bps_gc's codec state), and a run with the same folder resumes")
    return g


def method_params(args, parser):
    """{compressor, ...} of --method (None for none)."""
    compressor = METHODS[args.method]
    if compressor in ("topk", "randomk"):
        if not 0 < args.ratio < 1:
            parser.error(f"--ratio is the kept fraction and must be in (0, 1), got {args.ratio} "
                         "(for no compression use --compress none)")
        return {"compressor": compressor, "k": args.ratio}
    if compressor == "threshold":
        return {"compressor": "threshold", "threshold": args.threshold}
    if compressor == "qsgd":
        return {"compressor": "qsgd", "levels": args.qstates}
    if compressor == "terngrad":
        return {"compressor": "terngrad"}
    return None


def dgc_params(args, parser):
    if args.compressor != "dgc":
        parser.error(f"--compressor {args.compressor!r}: only dgc here (the study's codecs are --method)")
    if args.method != "none":
        parser.error(f"--compressor dgc and --method {args.method}: choose one")
    if not 0 < args.k < 1:
        parser.error(f"--k is DGC's kept fraction and must be in (0, 1), got {args.k}")
    params = {"compressor": "dgc", "k": args.k}
    if args.warmup_epochs:
        params["warmup_epochs"] = args.warmup_epochs
    if args.fp16_values:
        params["fp16_values"] = True
    if args.momentum > 0:  # DGC's momentum correction replaces the optimizer's momentum
        params["momentum"] = "nesterov" if args.nesterov else "plain"
    return params


def study_compression(args, parser):
    """The ``compression_params`` the flags ask for (None: dense). Checked here, so a bad value
    is one line before the cluster starts waiting."""
    if not 0 <= args.momentum < 1:
        parser.error(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.compressor:
        params = dgc_params(args, parser)
    elif args.compress == "none":
        if args.method != "none":
            parser.error(f"--method {args.method} needs --compress layerwise or entiremodel")
        return None
    else:
        params = method_params(args, parser)
        if params is None:
            codecs = ", ".join(m for m in METHODS if m != "none")
            parser.error(f"--compress {args.compress} needs a --method ({codecs})")
    if args.compress == "entiremodel":
        params["granularity"] = "entiremodel"
    check = dict(params, **({"mu": args.momentum} if "momentum" in params else {}))
    try:
        CompressionParams.from_dict(check)
    except ParamError as e:
        parser.error(str(e))
    return params


def compress_every_layer(args):
    """The study compresses every tensor: BYTEPS_MIN_COMPRESS_BYTES 0 unless set (read at init)."""
    if args.min_compress_bytes is not None:
        if args.min_compress_bytes < 0:
            raise SystemExit(f"--min-compress-bytes must be >= 0, got {args.min_compress_bytes}")
        os.environ["BYTEPS_MIN_COMPRESS_BYTES"] = str(args.min_compress_bytes)
    else:
        os.environ.setdefault("BYTEPS_MIN_COMPRESS_BYTES", "0")


def require_launcher(script):
    """bps_gc.init() needs a cluster: torchrun's or bpslaunch's variables."""
    if not (os.environ.get("DMLC_NUM_WORKER") or os.environ.get("WORLD_SIZE")):
        sys.exit(f"{script}: start it under torchrun (python -m torch.distributed.run --nproc-per-node N "
                 f"{script} ...) or bpslaunch (bpslaunch --local --workers N -- python {script} ...)")
