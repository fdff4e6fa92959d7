"""The command-line flags of the (post-)local SGD and CHOCO-SGD seed scripts (epfml/LocalSGD-Code,
epfml/ChocoSGD run.py), under their own names, and what each means here.

Booleans take the seeds' spelling ("True"/"False"). Flags that only make sense on their MPI
cluster are accepted: the ones that describe the job are checked against the one bpslaunch
started, the others are explained in --help and logged at start; none is silently ignored.
"""
import argparse

from bps_gc.compress import CompressionParams, ParamError
from torch_device import parse_device

OPTIMIZERS = ("sgd", "local_sgd", "post_local_sgd", "parallel_choco", "dpsgd",
              "local_sign_sgd", "local_ef_sign_sgd")
COMM_OPS = {"sign": "sign", "sign+norm": "sign+norm", "topk": "topk", "randomk": "randomk", "qsgd": "qsgd",
            # the seeds' own names for the same operators
            "compress_top_k": "topk", "compress_random_k": "randomk", "quantize_qsgd": "qsgd"}


def str2bool(value):
    if value.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if value.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")


def build_parser():
    p = argparse.ArgumentParser(
        description="CIFAR-10 ResNet with (post-)local SGD, CHOCO-SGD or D-PSGD on bps_gc, taking the "
                    "seed scripts' flags. Run it under bpslaunch --local --workers K (or a multi-machine "
                    "bpslaunch); the launcher replaces mpirun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    g = p.add_argument_group("algorithm")
    g.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS,
                   help="sgd: synchronous SGD (gradients averaged every step, compressed with --comm_op if "
                        "given); local_sgd: models averaged every --local_step steps; post_local_sgd: "
                        "synchronous until epoch --turn_on_local_step_from, then local; parallel_choco: "
                        "CHOCO-SGD with Q = --comm_op over --graph_topology; dpsgd: uncompressed D-PSGD; "
                        "local_sign_sgd / local_ef_sign_sgd: the seed's names for local_sgd with "
                        "--comm_op sign / sign+norm")
    g.add_argument("--local_step", type=int, default=1, help="H: steps between model averagings")
    g.add_argument("--turn_on_local_step_from", type=int, default=0,
                   help="post-local SGD: the epoch from which steps are local (before it every step averages)")
    g.add_argument("--graph_topology", default="complete",
                   help="ring, torus (2-D, the squarest factorization of K), complete, or an edge list "
                        "'0-1,1-2,...' (Metropolis weights); used by parallel_choco, dpsgd and "
                        "--lr_scaleup_factor graph")
    g.add_argument("--comm_op", default=None, choices=sorted(COMM_OPS),
                   help="the compression operator: sign (CHOCO: scaled sign; local SGD: signs and scales "
                        "averaged separately), sign+norm (scaled sign; with error feedback in local SGD and "
                        "sgd), topk / randomk (keep 1 - --compress_ratio of each tensor), qsgd "
                        "(--quantize_level levels); compress_top_k, compress_random_k and quantize_qsgd "
                        "are the seeds' names")
    g.add_argument("--compress_ratio", type=float, default=None,
                   help="the fraction of each tensor DROPPED by topk/randomk, as in the seeds: 0.99 keeps "
                        "1%% (bps_gc's k = 1 - compress_ratio, rounded up to a multiple of 32 elements)")
    g.add_argument("--quantize_level", type=int, default=16, help="qsgd: quantization levels")
    g.add_argument("--is_biased", type=str2bool, default=False, help="qsgd: the biased (unscaled) variant")
    g.add_argument("--choco_consenus_stepsize", "--choco_consensus_stepsize", "--consensus_stepsize",
                   dest="consensus_stepsize", type=float, default=0.45,
                   help="CHOCO's consensus step size gamma (the seed's spelling, a correct one, and run.py's)")
    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=0.1, help="base learning rate (for --base_batch_size)")
    g.add_argument("--base_batch_size", type=int, default=None,
                   help="the batch --lr is meant for: the rate is scaled by batch_size / base_batch_size")
    g.add_argument("--lr_scaleup", type=str2bool, default=False, help="multiply the rate by --lr_scaleup_factor")
    g.add_argument("--lr_scaleup_factor", default="world",
                   help="graph (the neighbourhood size, degree + 1, of --graph_topology), world (K), or a number")
    g.add_argument("--lr_warmup", type=str2bool, default=False,
                   help="warm up linearly from --lr to the scaled rate over --lr_warmup_epochs")
    g.add_argument("--lr_warmup_epochs", type=int, default=5)
    g.add_argument("--lr_schedule_scheme", "--lr_scheduler", dest="lr_schedule_scheme", default="custom_multistep",
                   choices=["custom_multistep", "MultiStepLR"], help="step decay at --lr_change_epochs (both names)")
    g.add_argument("--lr_change_epochs", "--lr_milestones", dest="lr_change_epochs", default="150,225",
                   help="epochs at which the rate decays, comma-separated")
    g.add_argument("--lr_decay", type=float, default=0.1,
                   help="decay factor: a value below 1 multiplies the rate (0.1), above 1 divides it (10)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--weight_decay", type=float, default=1e-4)
    g.add_argument("--use_nesterov", type=str2bool, default=False)
    g.add_argument("--momentum_factor", type=float, default=0.9, help="local momentum (never averaged)")
    g = p.add_argument_group("data and model")
    a("--arch", default="resnet20", help="resnet20, 32, 44, 56 or 110 (CIFAR ResNet v1)")
    a("--data", default="cifar10", choices=["cifar10"], help="the data set (the official CIFAR-10 python files)")
    a("--data_dir", default="./data/", help="directory holding cifar-10-batches-py/ (nothing is downloaded)")
    a("--batch_size", "-b", type=int, default=128, help="mini-batch size per worker")
    a("--num_workers", "-j", type=int, default=2, help="threads preparing batches (0: in the training loop)")
    a("--pin_memory", type=str2bool, default=True,
      help="page-locked batches for the copies to the GPU (training on CUDA pins them either way; on the "
           "CPU there is nothing to pin)")
    a("--partition_data", default="random", choices=["random", "none"],
      help="random: each worker a disjoint random share of the training set; none: every worker samples all of it")
    a("--reshuffle_per_epoch", type=str2bool, default=False, help="draw a new partition/order every epoch")
    a("--num_epochs", type=int, default=300)
    a("--stop_criteria", default="epoch", choices=["epoch", "iteration"],
      help="stop after --num_epochs, or after --num_iterations steps")
    a("--num_iterations", type=int, default=32000)
    a("--max_iters", type=int, default=0, help="at most this many steps per epoch (0: all; for quick runs)")
    a("--eval_freq", type=int, default=1, help="evaluate every this many epochs (and after the last)")
    a("--checkpoint", default="", help="a folder: each rank saves its state there after every epoch (model, "
                                        "optimizer, bps_gc's codec state), and a run with the same folder resumes")
    a("--avg_model", type=str2bool, default=False,
      help="at the end, every worker takes the average of all workers' models (the model reported)")
    a("--evaluate_avg", type=str2bool, default=False,
      help="at each evaluation also evaluate the averaged model (besides each worker's own)")
    a("--manual_seed", type=int, default=6, help="seed of the initial model, data order and codecs")
    a("--track_time", type=str2bool, default=False, help="time data, compute and communication per epoch")
    a("--display_tracked_time", type=str2bool, default=False, help="log the tracked times")
    a("--experiment", default=None, help="name of the run: the log is <experiment>.log (default: the optimizer)")
    g = p.add_argument_group("the seeds' cluster flags (MPI): mapped to bpslaunch or explained")
    g.add_argument("--n_mpi_process", type=int, default=None,
                   help="number of workers: must equal the workers bpslaunch started (--workers K)")
    g.add_argument("--n_sub_process", type=int, default=1,
                   help="GPUs per worker process: only 1 (start more workers instead)")
    g.add_argument("--world", default=None,
                   help="GPU ids of the processes (n_mpi_process * n_sub_process of them; a shorter list repeats, "
                        "as the seed's 8 ids for 16 processes): with --on_cuda True process r trains on GPU "
                        "world[r %% len]")
    g.add_argument("--on_cuda", type=str2bool, default=False,
                   help="train on CUDA (the seeds' flag): GPU --world[rank], else the local rank's; no GPU "
                        "here: a note and the CPU")
    g.add_argument("--device", type=parse_device, default=None,
                   help="auto, cpu, cuda or cuda:N: overrides --on_cuda/--world (default: what they say)")
    g.add_argument("--comm_device", default="cpu",
                   help="where messages are staged: cuda keeps compression on the GPU (device codec chains, "
                        "the default for CUDA tensors); payloads cross host memory to be sent (logged)")
    g.add_argument("--use_ipc", type=str2bool, default=False,
                   help="MPI shared-memory transport: bps_gc's ZeroMQ sockets are used whatever it says")
    g.add_argument("--hostfile", default=None,
                   help="MPI host list: hosts come from bpslaunch (DMLC_* variables) instead; not read")
    g.add_argument("--mpi_path", default=None, help="MPI installation: no MPI is used; not read")
    g.add_argument("--python_path", default=None,
                   help="interpreter mpirun starts: bpslaunch runs the command you give it; not read")
    p.add_argument("--dry-run", action="store_true",
                   help="join the job, check the flags against it, log the plan and every note, and exit "
                        "without training")
    return p


def given(argv, flag):
    """Whether ``flag`` is on the command line (as FLAG VALUE or FLAG=VALUE)."""
    return any(word.split("=", 1)[0] == flag for word in argv)


def unused_flag_notes(args, argv):
    """Notes for compression flags the chosen operator does not read (accepted, no effect)."""
    _, op = algorithm(args)
    notes = []
    if op not in ("topk", "randomk") and given(argv, "--compress_ratio"):
        notes.append(f"--compress_ratio {args.compress_ratio}: no effect with --comm_op {op} (topk/randomk only)")
    for flag in ("--quantize_level", "--is_biased"):
        if op != "qsgd" and given(argv, flag):
            notes.append(f"{flag}: no effect with --comm_op {op} (qsgd only)")
    return notes


def kept_fraction(args, parser):
    if args.compress_ratio is None or not 0 <= args.compress_ratio < 1:
        parser.error(f"--comm_op {args.comm_op} needs --compress_ratio in [0, 1) (the fraction dropped), "
                     f"got {args.compress_ratio}")
    return 1.0 - args.compress_ratio


def codec(name, fallback=None, **options):
    """{compressor: name, ...} when this bps_gc has it, else ``fallback`` (the same format)."""
    params = {"compressor": name, **options}
    try:
        CompressionParams.from_dict(params)
    except ParamError as e:
        if fallback is None:
            raise SystemExit(f"--comm_op needs the {name!r} codec, which this bps_gc lacks ({e})")
        return fallback
    return params


def signnorm():
    return codec("signnorm", fallback={"compressor": "onebit", "scaling": True})


def algorithm(args):
    """(optimizer, comm_op) with the seeds' local_*sign_sgd names resolved."""
    if args.optimizer == "local_sign_sgd":
        return "local_sgd", "sign"
    if args.optimizer == "local_ef_sign_sgd":
        return "local_sgd", "sign+norm"
    return args.optimizer, COMM_OPS.get(args.comm_op) if args.comm_op else None


def compression(args, parser):
    """compression_params for the chosen optimizer and --comm_op (None: uncompressed)."""
    optimizer, op = algorithm(args)
    if op is None:
        return None
    if optimizer == "dpsgd":
        parser.error("--optimizer dpsgd exchanges uncompressed models; use parallel_choco with --comm_op")
    if op in ("topk", "randomk"):
        return {"compressor": op, "k": kept_fraction(args, parser)}
    if op == "qsgd":
        return codec("qsgd", levels=args.quantize_level, biased=args.is_biased)
    decentralized = optimizer == "parallel_choco"
    if op == "sign" and decentralized:
        return signnorm()  # CHOCO needs a scaled Q: the seed's choco sign is sign+norm
    if op == "sign":
        return {"compressor": "sign"} if optimizer != "sgd" else {"compressor": "onebit"}
    return signnorm() if decentralized else dict(signnorm(), ef="vanilla")
