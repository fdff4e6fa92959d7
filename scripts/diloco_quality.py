"""DiLoCo's quality at equal tokens on the reduced LM yardstick (issue 44's Quality target):
the final validation loss of DDP and of DiLoCo, 2 and 4 replicas, over H, the outer learning
rate, the run's length and the inner peak learning rate.

    .venv/bin/python scripts/diloco_quality.py --out out/diloco_quality
    .venv/bin/python scripts/diloco_quality.py --quick        # a 1-minute look (150 steps only)
    .venv/bin/python scripts/diloco_quality.py --report out/diloco_quality*/diloco_quality.json   # runs together

The model, data, AdamW, warm-up + cosine schedule and clipping are the LM table's
(scripts/time_to_accuracy.py --task lm --layers 2 --width 64 --heads 4 --context 64
--batch-size 16, example/pytorch/lm/lm_training.py); replica r trains on rank r's batches
(stdlib_text.train_batch(seed, r, step)), so every row sees the same tokens at a step.

The replicas are simulated in ONE process, which is DiLoCo's arithmetic exactly and costs no
processes: each replica is its own model copy with its own inner AdamW (its state kept across
outer rounds, as the paper and bps_gc.torch.DiLoCo keep it), clipped on its own gradients;
every H inner steps the pseudo-gradients (global - local, float32) are averaged, the outer
SGD (Nesterov) steps the global copy and every replica restarts from it. Where H does not divide
the run's length a last outer round is taken at its end, so every row ends on a global copy
that has seen all of its tokens. DDP: one model, the replicas' batches' gradients averaged
each step, clipped, one AdamW step (the LM table's reference). What is evaluated is the
global copy (the LM table's convention), on the table's 64 fixed validation windows.

--table JSON (a time_to_accuracy.py --task lm run at these settings, 2 ranks) checks this
simulation against bps_gc.torch.DiLoCo on 2 real ranks: its `bps_gc DiLoCo H=50 dense` row's
losses at the outer steps, and DDP's, against the ones computed here at the same steps.

The grid (the default, cut to fit ~15 minutes of one core; --full runs every cell):
  150 steps: H in --every x outer lr in --outer-lr x replicas in --replicas, all of them;
             then, at H = 50 and each replica count's best outer lr, the peak inner lrs in
             --inner-lr;
  600 steps: --long-replicas only (2), H = 50 x every outer lr; then the other H at the outer
             lr that was best at H = 50 for that replica count and length.
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE] + [os.path.join(os.path.dirname(HERE), "example", p) for p in ("pytorch/lm", "pytorch")]
from diloco_quality_report import check_against_table, gaps, key, merged, plot, table_lines, verdict_lines  # noqa: E402


def parse_args(argv=None):
    from lm_training import add_model_args, add_optimizer_args
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_optimizer_args(p)
    p.set_defaults(layers=2, width=64, heads=4, context=64, batch_size=16)  # the reduced LM table's
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", default="150,600", help="run lengths (inner steps = DDP steps), comma-separated")
    p.add_argument("--replicas", default="2,4")
    p.add_argument("--every", default="25,50,100", help="H values")
    p.add_argument("--outer-lr", default="0.5,0.7,1.0")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov (0: plain SGD)")
    p.add_argument("--inner-lr", default="1.5e-3,6e-3", help="extra peak inner lrs (beside --lr) at H = 50, "
                   "150 steps, each replica count's best outer lr ('' for none)")
    p.add_argument("--long-replicas", default="2", help="the replica counts of the lengths after the first "
                   "(the cut grid's; --full: --replicas)")
    p.add_argument("--warm-start", type=int, default=0, metavar="K", help="DiLoCo rows: DDP's steps for the "
                   "first K inner steps (the replicas' gradients averaged), DiLoCo after (the paper starts from a "
                   "pretrained model); rounds every H steps from K on")
    p.add_argument("--warm-every", type=int, default=0, metavar="H0", help="with --warm-start K: the first K "
                   "steps are DiLoCo's with plain averaging (outer lr 1, no momentum) every H0 steps instead of "
                   "DDP's (K/H0 exchanges instead of K); H0 must divide K")
    p.add_argument("--thc-bits", type=int, default=0, metavar="B", help="DiLoCo rows: the pseudo-gradients "
                   "averaged through thc B-bit codes + error feedback, one codec per tensor and replica (the LM "
                   "yardstick's 'thc 4-bit' DiLoCo row, BYTEPS_MIN_COMPRESS_BYTES=0); 0: dense float32")
    p.add_argument("--full", action="store_true", help="every (H, outer lr, replicas) at every length")
    p.add_argument("--quick", action="store_true", help="the shortest length only")
    p.add_argument("--report", nargs="+", metavar="JSON", help="no training: the table and plot of these runs' "
                   "diloco_quality.json files together (--out gets the merged JSON)")
    p.add_argument("--table", help="a time_to_accuracy.py --task lm JSON at these settings: check the simulation")
    p.add_argument("--out", default="out/diloco_quality", help="folder for diloco_quality.json")
    p.add_argument("--plot", default="docs/img/diloco_quality.png", help="the gap-vs-H plot ('' for none)")
    args = p.parse_args(argv)
    floats = lambda s: [float(v) for v in s.split(",") if v]  # noqa: E731
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    args.steps, args.replicas, args.every = ints(args.steps), ints(args.replicas), ints(args.every)
    args.outer_lr, args.inner_lr = floats(args.outer_lr), floats(args.inner_lr)
    args.long_replicas = args.replicas if args.full else ints(args.long_replicas)
    if args.lr is None:
        args.lr = 3e-3 if args.optimizer == "adamw" else 0.3
    if args.warm_every and (args.warm_every < 1 or args.warm_start % args.warm_every):
        p.error(f"--warm-every {args.warm_every}: give a positive divisor of --warm-start ({args.warm_start})")
    if args.quick:
        args.steps = args.steps[:1]
    for name in ("steps", "replicas", "every"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            p.error(f"--{name}: give positive integers, got {getattr(args, name)}")
    return args


class Study:
    """The corpus, the validation windows and the two trainings (DDP, DiLoCo) in this process."""

    def __init__(self, args, bar=None):
        import torch
        from stdlib_text import Corpus, val_windows
        from torch_device import MixedPrecision
        torch.set_num_threads(1)
        self.torch, self.args, self.bar = torch, args, bar
        self.corpus = Corpus(args.corpus).check(args.context, args.val_windows)
        self.val = val_windows(self.corpus.val, args.val_windows, args.context)
        self.amp = MixedPrecision(torch.device("cpu"))

    def settings(self, steps, inner_lr=None):
        """The run's args: its length sets the cosine's end; ``inner_lr`` the peak."""
        return argparse.Namespace(**{**vars(self.args), "steps": steps, "lr": inner_lr or self.args.lr})

    def batch(self, replica, step):
        from stdlib_text import train_batch
        return (self.torch.from_numpy(a) for a in train_batch(self.corpus.train, self.args.seed, replica, step,
                                                               self.args.batch_size, self.args.context))

    def evaluate(self, model):
        from lm_training import evaluate
        return evaluate(model, self.val, self.torch.device("cpu"), self.amp)

    def set_lr(self, opt, run, step):
        from lm_training import lr_at
        for group in opt.param_groups:
            group["lr"] = lr_at(run, step)

    def tick(self, n):
        if self.bar is not None:
            self.bar.update(n)

    def ddp(self, replicas, steps, eval_every=25):
        """[(step, val loss)] of DDP: the replicas' gradients averaged, clipped, one step."""
        from gpt import byte_loss
        from lm_training import build_model, make_optimizer
        run = self.settings(steps)
        model = build_model(run, self.torch.device("cpu"))
        opt = make_optimizer(run, model)
        curve = [(0, self.evaluate(model))]
        for step in range(steps):
            self.set_lr(opt, run, step)
            opt.zero_grad()
            for r in range(replicas):
                x, y = self.batch(r, step)
                (byte_loss(model(x), y) / replicas).backward()
            if run.clip > 0:
                self.torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip)
            opt.step()
            self.tick(replicas)
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                curve.append((step + 1, self.evaluate(model)))
        return curve

    def diloco(self, replicas, steps, every, outer_lr, momentum=0.9, inner_lr=None, warm=0, thc_bits=0, warm_every=0):
        """[(step, val loss of the global copy)] after each outer round of DiLoCo (after the
        first ``warm`` steps, DDP's: every replica steps with the replicas' mean gradient; or,
        with ``warm_every``, plain averaging every ``warm_every`` steps in them);
        ``thc_bits``: the pseudo-gradients averaged through thc codes (``ThcMean``)."""
        torch = self.torch
        from gpt import byte_loss
        from lm_training import build_model, make_optimizer
        run = self.settings(steps, inner_lr)
        deploy = build_model(run, torch.device("cpu"))  # the global copy is evaluated in it
        copies = [p.detach().float().clone() for p in deploy.parameters()]
        outer = torch.optim.SGD(copies, lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
        plain = torch.optim.SGD(copies, lr=1.0)  # the warm phase's rounds: the replicas' mean
        local = [copy.deepcopy(deploy) for _ in range(replicas)]
        inner = [make_optimizer(run, m) for m in local]
        thc = ThcMean(copies, replicas, thc_bits) if thc_bits else None
        curve = [(0, self.evaluate(deploy))]
        for step in range(steps):
            for r, (model, opt) in enumerate(zip(local, inner)):
                self.set_lr(opt, run, step)
                opt.zero_grad()
                x, y = self.batch(r, step)
                byte_loss(model(x), y).backward()
                if step >= warm or warm_every:
                    self.clipped_step(model, opt, run.clip)
            if step < warm and not warm_every:  # DDP: the same mean gradient, clip and step on every replica
                with torch.no_grad():
                    for ps in zip(*(m.parameters() for m in local)):
                        mean = sum(p.grad for p in ps) / replicas
                        for p in ps:
                            p.grad.copy_(mean)
                for model, opt in zip(local, inner):
                    self.clipped_step(model, opt, run.clip)
                if step + 1 == warm:  # the global copy starts from DDP's parameters
                    with torch.no_grad():
                        for c, p in zip(copies, local[0].parameters()):
                            c.copy_(p)
            self.tick(replicas)
            early = step < warm and warm_every and (step + 1) % warm_every == 0
            if early or step >= warm and ((step + 1 - warm) % every == 0 or step + 1 == steps):
                self.outer_round(copies, plain if early else outer, local, thc)
                with torch.no_grad():
                    for p, c in zip(deploy.parameters(), copies):
                        p.copy_(c)
                curve.append((step + 1, self.evaluate(deploy)))
        self.global_copy = copies  # tests/test_diloco.py compares it with bps_gc.torch.DiLoCo's
        return curve

    def clipped_step(self, model, opt, clip):
        if clip > 0:
            self.torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()

    @staticmethod
    def outer_round(copies, outer, local, mean=None):
        """The pseudo-gradients' average as the global copy's gradient; the outer step; every
        replica restarts from the global copy (bps_gc.torch.DiLoCo's start_sync + finish_sync)."""
        import torch
        with torch.no_grad():
            params = [list(m.parameters()) for m in local]
            for i, c in enumerate(copies):
                deltas = [c - ps[i].detach().float() for ps in params]
                c.grad = sum(deltas) / len(local) if mean is None else mean(i, deltas)
            outer.step()
            outer.zero_grad(set_to_none=True)
            for ps in params:
                for p, c in zip(ps, copies):
                    p.copy_(c)


class ThcMean:
    """The replicas' average of tensor i through thc: each replica's codec (its own error
    feedback, kept across outer rounds) encodes its pseudo-gradient against the scale the
    summed histograms agree on, the int64 code words are summed, as an all_reduce sums them,
    and the sum is decoded once (bps_gc/compress/thc.py's two phases)."""

    def __init__(self, copies, replicas, bits):
        import numpy as np
        from bps_gc.compress.params import CompressionParams
        from bps_gc.compress.thc import THC
        params = CompressionParams.from_dict({"compressor": "thc", "bits": bits, "feedback": True})
        self.codecs = [[THC(params, c.numel(), np.float32, seed=i) for i, c in enumerate(copies)]
                       for _ in range(replicas)]
        for codec in (c for per in self.codecs for c in per):
            codec.set_summands(replicas, np.int64)

    def __call__(self, i, deltas):
        import torch
        codecs = [per[i] for per in self.codecs]
        hist = sum(c.compress(d.numpy().reshape(-1)).view(c.phase_dtype) for c, d in zip(codecs, deltas))
        words = sum(c.compress_q(hist.view("uint8")).view(c.phase_dtype) for c in codecs)
        total = codecs[0].finish(words.view("uint8"), workers=len(codecs))
        return torch.from_numpy(total / len(codecs)).view_as(deltas[0]).to(deltas[0].dtype)


def plan(args):
    """The first cells: (kind, replicas, steps, H, outer lr, inner lr); the adaptive ones follow."""
    cells = [("ddp", r, s, None, None, None) for s in args.steps for r in replicas_at(args, s)]
    for s in args.steps:
        full = args.full or s == args.steps[0]
        for r in replicas_at(args, s):
            for h in (args.every if full else [h for h in args.every if h == 50] or args.every[:1]):
                cells += [("diloco", r, s, h, lr, None) for lr in args.outer_lr]
    return cells


def replicas_at(args, steps):
    return args.replicas if steps == args.steps[0] else args.long_replicas


def adaptive(args, results):
    """The cells chosen from the first ones' losses: the inner lrs and the cut grid's other H."""
    cells = []
    anchor = 50 if 50 in args.every else args.every[0]
    for s in args.steps:
        for r in replicas_at(args, s):
            best = best_outer_lr(results, r, s, anchor, args.outer_momentum, args.warm_start)
            if s == args.steps[0]:
                cells += [("diloco", r, s, anchor, best, lr) for lr in args.inner_lr if lr != args.lr]
            if not (args.full or s == args.steps[0]):
                cells += [("diloco", r, s, h, best, None) for h in args.every if h != anchor]
    return cells


def best_outer_lr(results, replicas, steps, every, momentum=0.9, warm=0):
    """The outer lr of the lowest final loss among the rows at --lr with these settings."""
    rows = [r for r in results.values() if r["kind"] == "diloco" and r["inner_lr"] is None and r["replicas"] == replicas
            and r["steps"] == steps and r["every"] == every and r.get("outer_momentum", 0.9) == momentum
            and r.get("warm_start", 0) == warm]
    return min(rows, key=lambda r: r["final"])["outer_lr"]


def run_cells(study, cells, results, save=None):
    for kind, r, s, h, lr, inner in cells:
        momentum, warm, bits = study.args.outer_momentum, study.args.warm_start, study.args.thc_bits
        warm_every = study.args.warm_every if warm else 0
        name = key(kind, r, s, h, lr, inner, momentum, warm, bits, warm_every)
        if name in results:
            continue
        began = time.perf_counter()
        curve = study.ddp(r, s) if kind == "ddp" else study.diloco(r, s, h, lr, momentum, inner, warm, bits, warm_every)
        results[name] = {"kind": kind, "replicas": r, "steps": s, "every": h, "outer_lr": lr, "inner_lr": inner,
                         "outer_momentum": momentum if kind == "diloco" else None, "warm_start": warm, "warm_every": warm_every,
                         "thc_bits": bits if kind == "diloco" else 0, "curve": curve, "final": curve[-1][1], "seconds": time.perf_counter() - began}
        if save:
            save(results)


def passes(cells):
    return sum(r * s for _, r, s, _, _, _ in cells)


def main(argv=None):
    from tqdm import tqdm
    from bench_common import machine_info
    args = parse_args(argv)
    if args.report:
        results, heads = merged(args.report)
        lines = [machine_info()] + heads + table_lines(gaps(results), args) + verdict_lines(results, args)
        print("\n".join(lines))
        os.makedirs(args.out, exist_ok=True)
        json.dump({"command": sys.argv, "lines": lines, "rows": results},
                  open(os.path.join(args.out, "diloco_quality.json"), "w"), indent=1)
        if args.plot:
            plot(args.plot, results, args)
        return
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    began, results = time.time(), {}
    cells = plan(args)
    # the adaptive cells' count is known before their settings: the bar's total is exact
    extra = sum(r * s for s in args.steps[:1] for r in args.replicas for lr in args.inner_lr if lr != args.lr)
    extra += 0 if args.full else sum(r * s for s in args.steps[1:] for r in args.long_replicas
                                     for h in args.every if h != (50 if 50 in args.every else args.every[0]))
    with tqdm(total=passes(cells) + extra, unit="pass", desc="replica-steps", smoothing=0.05) as bar:
        study = Study(args, bar)
        partial = os.path.join(args.out, "diloco_quality.partial.json")  # a cut-short sweep keeps its rows
        os.makedirs(args.out, exist_ok=True)
        save = lambda rows: json.dump({"command": sys.argv, "rows": rows}, open(partial, "w"))  # noqa: E731
        run_cells(study, cells, results, save)
        run_cells(study, adaptive(args, results), results, save)
    os.remove(partial)
    gaps(results)
    head = [f"{machine_info()}; one process, one thread; {load}",
            f"reduced LM: {args.layers} layers x {args.width}, {args.heads} heads, context {args.context}, batch "
            f"{args.batch_size} per replica and step, AdamW peak {args.lr:g} (warm-up {args.warmup}, cosine to /10), "
            f"clip {args.clip}; outer SGD momentum {args.outer_momentum} Nesterov; {time.time() - began:.0f} s in all"]
    lines = head + table_lines(results, args) + verdict_lines(results, args)
    if args.table:
        lines += check_against_table(args.table, results)
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    json.dump({"command": sys.argv, "machine": machine_info(), "uptime": load, "lines": lines,
               "settings": {k: v for k, v in vars(args).items() if k not in ("table",)},
               "rows": results}, open(os.path.join(args.out, "diloco_quality.json"), "w"), indent=1)
    if args.plot:
        plot(args.plot, results, args)
        print(f"plot: {args.plot}; JSON: {os.path.join(args.out, 'diloco_quality.json')}")


if __name__ == "__main__":
    main()
