"""scripts/time_to_accuracy.py --task lm: the small GPT of example/pytorch/lm on the standard
library's source, 2 machines x --local-ranks ranks, AdamW, batch --batch-size per rank.

Each rank process first trains THE REFERENCE: dense DDP's arithmetic without its exchange. It
runs every rank's batch of a step itself, one after the other, sums the gradients / ranks
(what DDP's average is; tests/test_lm.py checks that two DDP ranks equal one process on the
concatenated batch), clips and steps, so its validation curve by step is DDP dense's on any
link. It times its own batch's forward and backward and the optimizer step: the compute-only
time of one step of a rank (the median over the steps, the mean over the ranks), on the same
ranks, beside the same processes. From it:

    target         = the reference's final validation loss + --slack
    the limit      = the reference's steps to the target x that compute-only step time
    cap            = --cap-factor x the limit; a row still short of the target then stops there

Then each configuration trains from the same initial weights on the link for --steps steps
and on, at the schedule's last rate, until it reaches the target (at most 10x --steps), or to
the cap, whichever comes first; its loss at --steps is the "val loss @ steps" column (at the
step it stopped when the cap came first). Rank 0 evaluates every --eval-every steps with the
clock stopped. Bytes per rank per step: bps_gc's rows, its own counter of the bytes a rank pushes (bps.metrics()); torch's
hooks, the bytes of the tensors a rank hands to all_reduce / all_gather (counted by wrapping
them); DDP dense, its gradient's bytes (its C++ reducer all-reduces all of them every step).

The DiLoCo rows (bps_gc.torch.DiLoCo on torch.distributed, issue 44; scripts/tta_lm_diloco.py,
with its warm-phase flags): every rank is a replica with the same AdamW, schedule and clipping
as the other rows as its inner optimizer, and the paper's outer Nesterov SGD (lr 0.7, momentum
0.9; --diloco-outer-lr sets its lr); H = --diloco-every inner steps between a fragment's syncs; "F=4 tau=1" is Streaming
DiLoCo (4 staggered fragments, each exchange overlapped with one inner step). Steps count inner steps, and bytes are per inner step. What is
evaluated is what a user would deploy: the global copy, each fragment's as of its last applied
outer step (an exchange in flight not included), not a replica's drifting local parameters. An
evaluation step waits for any exchange in flight first, inside the timed step (gloo runs one
collective at a time; the wait gives up that step's overlap, a pessimistic choice). Where
torchft imports (an opt-in extra), torchft's DiLoCo with the dense rows' settings (F=1, and F=4
tau=1 where H is a multiple of 4) is a row too (scripts/tta_lm_torchft.py); a line of the table
says which of its rows are absent and why.
"""
import argparse
import contextlib
import math
import os
import statistics
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "example", p)
                for p in ("pytorch/lm", "pytorch", "")]
from tta_lm_diloco import (DILOCO, TORCHFT_PHASE, add_diloco_args, check_diloco_args, diloco_rows,  # noqa: E402,F401
                           make_diloco)

# bps_gc's DDP hook rows (AdamW); the parameter-server rows' DistributedOptimizer recipes
HOOKS = {"bps_gc hook onebit + EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
         "bps_gc hook topk 1% + EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"},
         "bps_gc hook DGC 0.1%": {"compressor": "dgc", "k": 0.001},
         "bps_gc hook thc 4-bit": {"compressor": "thc", "bits": 4, "feedback": True}}
# the demo's recipe moves SGD's momentum into the codec chain: it trains with SGD (--sgd-lr)
RECIPES = {"onebit + EF + nesterov (SGD)": {"compressor": "onebit", "scaling": True, "ef": "vanilla",
                                            "momentum": "nesterov"},
           "thc 4-bit": {"compressor": "thc", "bits": 4, "feedback": True}}
REFERENCE = "reference"
COLLECTIVE = (REFERENCE, "DDP dense", "DDP bf16 hook", "DDP PowerSGD rank 1", "DDP PowerSGD rank 4", *HOOKS)
PS = tuple(f"bps_gc PS {r}" for r in RECIPES)
LIMIT = "the limit (no exchange)"


def collective_rows(args):
    """The torch.distributed run's configurations: the reference, COLLECTIVE's rows, DiLoCo's
    (torchft's where it imports)."""
    import tta_lm_torchft as ft
    return (*COLLECTIVE, *diloco_rows(args), *(() if ft.importable() else ft.rows(args.diloco_every)))


MAX_STEPS_FACTOR = 10  # a row short of the target goes on to at most this many times --steps


def add_args(p):
    """--task lm's flags (the model's, data's and optimizer's are train.py's)."""
    from lm_training import add_model_args, add_optimizer_args
    g = add_model_args(p)
    g.add_argument("--steps", type=int, default=400, help="lm: steps of every row")
    g.add_argument("--seed", type=int, default=0, help="lm: initial weights and batches")
    g.add_argument("--cap-factor", type=float, default=3.0,
                   help="lm: a row stops at this many times the limit's time to the target")
    g.add_argument("--sgd-lr", type=float, default=0.3, help="lm: the SGD recipe row's peak rate")
    add_diloco_args(g)  # scripts/tta_lm_diloco.py
    g.add_argument("--cap-seconds", type=float, default=None, help=argparse.SUPPRESS)
    g.add_argument("--target", type=float, default=None, help=argparse.SUPPRESS)
    add_optimizer_args(p)


@contextlib.contextmanager
def counted_collectives(counter):
    """torch.distributed's all_reduce / all_gather add the bytes of what this rank sends to
    counter[0] while inside (torch's PowerSGD and compression hooks call them from Python)."""
    import torch.distributed as dist
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor")}

    def wrap(name, fn):
        def counting(*args, **kwargs):
            tensor = args[1] if name != "all_reduce" else args[0]
            counter[0] += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return counting
    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class Run:
    """One rank's side of the benchmark: the corpus, the validation set and the collectives."""

    def __init__(self, args):
        import torch
        import bps_gc.torch as bps
        from stdlib_text import Corpus, val_windows
        from torch_device import MixedPrecision
        torch.set_num_threads(1)
        self.torch, self.bps, self.args = torch, bps, args
        self.corpus = Corpus(args.corpus).check(args.context, args.val_windows)
        self.val = val_windows(self.corpus.val, args.val_windows, args.context)
        self.device = torch.device("cpu")
        self.amp = MixedPrecision(self.device)
        bps.init()
        self.rank, self.size = bps.rank(), bps.size()

    def mean(self, values, name="tta.sync"):
        return [v / self.size for v in self.bps.push_pull(self.torch.tensor(values, dtype=self.torch.float64),
                                                           average=False, name=name).tolist()]

    def batch(self, rank, step):
        from stdlib_text import train_batch
        return (self.torch.from_numpy(a) for a in train_batch(self.corpus.train, self.args.seed, rank, step,
                                                               self.args.batch_size, self.args.context))

    def fresh(self, sgd=False):
        from lm_training import build_model, make_optimizer
        model = build_model(self.args, self.device)
        args = self.args
        if sgd:
            args = type(args)(**{**vars(args), "optimizer": "sgd", "lr": args.sgd_lr})
        return model, make_optimizer(args, model), args

    def set_lr(self, opt, args, step):
        from lm_training import lr_at
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)

    def evaluate(self, model):
        from lm_training import evaluate
        return evaluate(model, self.val, self.device, self.amp) if self.rank == 0 else 0.0

    def shared_loss(self, model):
        """Rank 0's validation loss, on every rank."""
        return self.mean([self.evaluate(model) * self.size], "tta.loss")[0]

    def reference(self):
        """Dense DDP's arithmetic in this process; its curve [(step, loss)] and the compute-only
        seconds of one step of this rank (its own batch's forward and backward, and the step)."""
        from gpt import byte_loss
        from lm_training import clipped_step
        torch, args = self.torch, self.args
        model, opt, _ = self.fresh()
        curve, compute = [(0, self.shared_loss(model))], []
        for step in range(args.steps):
            self.set_lr(opt, args, step)
            opt.zero_grad()
            mine = 0.0
            for r in range(self.size):
                x, y = self.batch(r, step)
                began = time.perf_counter()
                (byte_loss(model(x), y) / self.size).backward()
                if r == self.rank:
                    mine += time.perf_counter() - began
            began = time.perf_counter()
            clipped_step(opt, model, args.clip, synchronizes=False)
            compute.append(mine + time.perf_counter() - began)
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                curve.append((step + 1, self.shared_loss(model)))
        # the median step: the other jobs' bursts on a shared box are not this model's cost
        seconds = self.mean([statistics.median(compute)], "tta.reference")[0]
        return {"curve": curve, "compute_seconds_per_step": seconds}

    def wrapped(self, config):
        """(model, net, opt, args, synchronizes) for ``config``."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel as DDP
        bps = self.bps
        if config.startswith("bps_gc PS"):
            recipe = RECIPES[config[len("bps_gc PS "):]]
            model, opt, args = self.fresh(sgd="momentum" in recipe)
            opt = bps.DistributedOptimizer(opt, named_parameters=[(f"{config}.{n}", p) for n, p in
                                                                  model.named_parameters()],
                                           compression_params=recipe)
            return model, model, opt, args, True
        model, opt, args = self.fresh()
        diloco = diloco_rows(args)
        if config.startswith("torchft DiLoCo"):
            from tta_lm_torchft import TorchftDiLoCo, rows
            return model, model, TorchftDiLoCo(model, opt, args.diloco_every, self.rank, self.size,
                                               *rows(args.diloco_every)[config]), args, False
        if config in diloco:
            return model, model, make_diloco(bps, model, opt, args, diloco[config]), args, False
        net = DDP(model)
        if config == "DDP bf16 hook":
            # DDP refuses torch's bf16 hook by its name without NCCL; gloo all-reduces bfloat16 fine
            net.register_comm_hook(None, lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket))
        elif config.startswith("DDP PowerSGD"):
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(config[-1]), start_powerSGD_iter=2)
            net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif config in HOOKS:
            net.register_comm_hook(None, bps.comm_hook(HOOKS[config], optimizer=opt,
                                                       named_parameters=[(f"{config}.{n}", p) for n, p in
                                                                         model.named_parameters()]))
        return model, net, opt, args, False

    def deployed(self, model, opt):
        """What is evaluated: ``model``; a DiLoCo replica's global copy (its fragments' copies as
        of their last applied outer step) in a model of its own, made once per row."""
        from tta_lm_torchft import TorchftDiLoCo
        if not isinstance(opt, (self.bps.DiLoCo, TorchftDiLoCo)):
            return model
        if getattr(self, "deploy_for", None) is not opt:
            import copy
            self.deploy_for, self.deploy = opt, copy.deepcopy(model)
        if isinstance(opt, TorchftDiLoCo):
            opt.deploy_into(self.deploy)
            return self.deploy
        from lm_diloco import load_global_copy  # train.py --api diloco evaluates the same
        return load_global_copy(opt, self.deploy)

    def train(self, config, cap_seconds, target):
        """{curve: [(step, seconds, loss)], bytes_per_step, capped} of ``config`` on the link."""
        import bps_gc.core
        from gpt import byte_loss
        from lm_training import clipped_step
        model, net, opt, args, synchronizes = self.wrapped(config)
        torch_hook = config.startswith("DDP") and config != "DDP dense"
        diloco = isinstance(opt, self.bps.DiLoCo)
        counter, sent = [0], 0
        curve, clock, capped, reached = [(0, 0.0, self.evaluate(self.deployed(model, opt)))], 0.0, False, False
        self.bps.barrier()
        bps_gc.core.metrics()  # reset
        around = (counted_collectives(counter) if torch_hook else opt.running(counter)
                  if config.startswith("torchft") else contextlib.nullcontext())
        with around:
            for step in range(MAX_STEPS_FACTOR * args.steps):
                began = time.perf_counter()
                self.set_lr(opt, args, step)  # past --steps: the schedule's floor, --lr / 10
                x, y = self.batch(self.rank, step)
                opt.zero_grad()
                byte_loss(net(x), y).backward()
                clipped_step(opt, model, args.clip, synchronizes)
                done = step + 1
                evaluating = not (done % args.eval_every and done != args.steps)
                if diloco and evaluating:  # no exchange in flight beside the evaluation's collectives
                    opt.wait()
                clock += time.perf_counter() - began
                if not evaluating:
                    continue
                sent, counted = sent + bps_gc.core.metrics().pushed_wire, counter[0]
                clock, loss = self.mean([clock, self.evaluate(self.deployed(model, opt)) * self.size])  # rank 0's
                bps_gc.core.metrics()  # the line above is not the training's exchange: not counted
                counter[0] = counted
                curve.append((done, clock, loss))
                reached = reached or loss <= target
                if clock > cap_seconds and not (reached and done >= args.steps):
                    capped = True
                    break
                if reached and done >= args.steps:
                    break
        if diloco:
            opt.wait()  # a gloo work pending as the next row starts (or at exit) can abort the job
        if config == "DDP dense":
            sent = 4 * sum(p.numel() for p in model.parameters()) * curve[-1][0]
        steps = curve[-1][0]
        return {"curve": curve, "bytes_per_step": (sent + counter[0]) / max(steps, 1), "capped": capped}


def targets(reference, args):
    """(target loss, the reference's steps to it, the limit's seconds, the cap's seconds)."""
    target = reference["curve"][-1][1] + args.slack
    steps = next(s for s, loss in reference["curve"] if loss <= target and s > 0)  # trained steps
    limit = steps * reference["compute_seconds_per_step"]
    return target, steps, limit, args.cap_factor * limit


def check_corpus(args):
    """A corpus too small for the windows asked for: one line, before any cluster starts."""
    from stdlib_text import Corpus
    Corpus(args.corpus).check(args.context, args.val_windows)


def rank_main(args):
    """The rank's configurations (--configs) one after the other; rank 0 writes --rank-out."""
    import json
    run = Run(args)
    out = {"rows": {}}
    configs = args.configs.split(",")
    if REFERENCE in configs:
        out["reference"] = run.reference()
        target, _, _, cap = targets(out["reference"], args)
    else:
        target, cap = args.target, args.cap_seconds
    for config in configs:
        if config == REFERENCE:
            continue
        out["rows"][config] = run.train(config, cap, target)
        if run.rank == 0:
            row = out["rows"][config]
            print(f"{config}: {row['curve'][-1][1]:.1f} s, step {row['curve'][-1][0]}, val loss "
                  f"{row['curve'][-1][2]:.4f}{' (capped)' if row['capped'] else ''}", flush=True)
    if run.rank == 0:
        json.dump(out, open(args.rank_out, "w"))
    run.bps.shutdown()


def table(args, results):
    """The rows of the table: {name: {...}} with the limit first, and the target."""
    target, ref_steps, limit, cap = targets(results["reference"], args)
    rows = {LIMIT: {"seconds_to_target": limit, "vs_limit": 1.0, "steps_to_target": ref_steps,
                    "bytes_per_rank_step": 0, "final_val_loss": results["reference"]["curve"][-1][1],
                    "steps_done": args.steps, "capped": False, "stopped_at_step": args.steps,
                    "loss_when_stopped": results["reference"]["curve"][-1][1],
                    "seconds": args.steps * results["reference"]["compute_seconds_per_step"]}}
    for name, r in results["rows"].items():
        hit = next(((s, t) for s, t, loss in r["curve"] if loss <= target and s > 0), None)
        at_steps = [(s, loss) for s, _, loss in r["curve"] if s <= args.steps][-1]  # equal steps
        rows[name] = {"seconds_to_target": hit[1] if hit else None, "vs_limit": hit[1] / limit if hit else None,
                      "steps_to_target": hit[0] if hit else None, "bytes_per_rank_step": r["bytes_per_step"],
                      "final_val_loss": at_steps[1], "steps_done": at_steps[0], "capped": r["capped"],
                      "stopped_at_step": r["curve"][-1][0], "loss_when_stopped": r["curve"][-1][2],
                      "seconds": r["curve"][-1][1]}
    return rows, {"target": target, "limit_seconds": limit, "cap_seconds": cap,
                  "compute_seconds_per_step": results["reference"]["compute_seconds_per_step"]}


def print_table(rows, info, rate_bits=None):
    """The table; with the link's ``rate_bits``, each row's bytes as milliseconds on it too
    (a row whose ms/step is well above compute-only + link ms waits on this box's CPUs)."""
    link = f" {'link ms':>7}" if rate_bits else ""
    print(f"target: val loss <= {info['target']:.4f} nats/byte ({info['target'] / math.log(2):.3f} bits); "
          f"compute-only step {info['compute_seconds_per_step'] * 1000:.1f} ms; cap {info['cap_seconds']:.1f} s")
    print(f"{'':40} {'s to target':>11} {'x limit':>8} {'steps':>6} {'bytes/rank/step':>15} {'val loss @ steps':>17} {'stopped: loss @ step':>20} {'ms/step':>7}{link}")
    for name, r in rows.items():
        t = (f"{r['seconds_to_target']:11.1f}" if r["seconds_to_target"] is not None else
             f"{'> cap' if r['capped'] else 'never':>11}")
        ratio = f"{r['vs_limit']:7.2f}x" if r["vs_limit"] else f"{'-':>8}"
        steps = f"{r['steps_to_target']:6d}" if r["steps_to_target"] else f"{'-':>6}"
        print(f"{name:40} {t} {ratio} {steps} {r['bytes_per_rank_step']:15,.0f} "
              f"{r['final_val_loss']:9.4f} @ {r['steps_done']:<5d} {r['loss_when_stopped']:12.4f} @ {r['stopped_at_step']:<5d}"
              f" {1000 * r['seconds'] / r['stopped_at_step']:7.1f}"
              + (f" {8000 * r['bytes_per_rank_step'] / rate_bits:7.1f}" if rate_bits else ""))


def report(args, results, where):
    """Print the table, write the JSON and the plot (time_to_accuracy.py's save)."""
    from bench_common import machine_info
    from time_to_accuracy import ranks_of, save
    rows, info = table(args, results)
    print(f"{ranks_of(args)}, {where}; {machine_info()}; {args.steps} steps of {args.batch_size} x {args.context} "
          f"bytes per rank; model {args.layers} layers x {args.width}")
    from bench_common import import_netns
    print_table(rows, info, import_netns().parse_rate(args.shaped) if args.shaped else None)
    from tta_lm_torchft import table_line
    print(table_line(args.diloco_every))
    reference = results["reference"]["curve"]
    dense = results["rows"].get("DDP dense", {}).get("curve", [])
    same_step = [(s, loss, dict(reference).get(s)) for s, _, loss in dense if s in dict(reference)]
    if same_step:  # DDP dense on the link against its arithmetic without the exchange
        s, on_link, ref = same_step[-1]
        print(f"check: DDP dense's val loss at step {s} is {on_link:.5f}, the reference's {ref:.5f}")
    summary = {"task": "lm", **info, "link": where, "command": sys.argv, "machines": args.machines,
               "local_ranks": args.local_ranks, "machine": machine_info(), "steps": args.steps,
               "model": {k: getattr(args, k) for k in ("layers", "width", "heads", "context", "batch_size")},
               "rows": rows, "reference": results["reference"],
               "curves": {name: r["curve"] for name, r in results["rows"].items()}}
    series = {name: ([t for _, t, _ in r["curve"]], [loss for _, _, loss in r["curve"]])
              for name, r in results["rows"].items()}
    per_step = info["compute_seconds_per_step"]
    series[LIMIT] = ([s * per_step for s, _ in reference], [loss for _, loss in reference])
    save(args, summary, series, info["target"], "validation loss (nats per byte)")


def report_again(args):
    """--report JSON: the table, JSON and plot of an earlier run's JSON, printed by this code."""
    import json
    saved = json.load(open(args.report))
    results = {"reference": saved["reference"],
               "rows": {name: {"curve": curve, "bytes_per_step": saved["rows"][name]["bytes_per_rank_step"],
                               "capped": saved["rows"][name]["capped"]} for name, curve in saved["curves"].items()}}
    report(args, results, saved["link"])
