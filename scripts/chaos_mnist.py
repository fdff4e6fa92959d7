"""``scripts/chaos_elastic.py --task mnist``: the churn loop on real training.

The worker hosts run example/pytorch/train_mnist_elastic.py (torch, DistributedOptimizer, a
sampler that re-deals the digits over the members). There is no numpy oracle for torch's steps,
so the loop checks that the live hosts agree: the same CRC of the parameters' bytes at every
step they share, bit-identical final parameters, bps.size()/membership_epoch() as logged. Then
it runs the example undisturbed (no event) on as many hosts as the churned job had on average
over its steps (step-weighted, rounded), the same number of steps, once per seed
0..--baseline-seeds-1, replays the churned run's own membership sequence step by step in one
process (scripts/mnist_replay.py: the same batches per step, no death, no join protocol) for
the same seeds, and sets the churned run's final losses (over all training digits, and over the
1,000 held-out digits; the example seeded by --model-seed) beside both. The training loss is
near zero and follows the membership path at a fixed learning rate; the held-out loss is what
"within the noise of an undisturbed run" is judged on (its distance from the undisturbed runs'
mean, in their spreads, given from two runs on). With --scale-lr R every one of these runs, the
churned, the undisturbed and the replayed, takes lr x its step's hosts / R (the linear scaling
rule), and the loop also checks each host's logged lr against the logged sequence.
"""
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "example", "pytorch", "train_mnist_elastic.py")
BASELINE_BOUND = 300.0


LR = 0.1  # the example's --lr, passed explicitly: the lr rule is checked against it


def worker_command(out, stop_file, seed=0, steps=None, scale_lr=None):
    command = [sys.executable, EXAMPLE, "--out", out, "--seed", str(seed), "--sleep", "0.02", "--lr", str(LR)]
    command += ["--scale-lr", repr(scale_lr)] if scale_lr is not None else []
    return command + (["--stop-file", stop_file] if stop_file else ["--steps", str(steps)])


def lr_rule(scale_lr):
    return f"lr {LR:g} x hosts / {scale_lr:g}" if scale_lr is not None else f"lr {LR:g}"


def check(hosts, members, epochs, last, scale_lr=None):
    """The live hosts agree step by step and at the end (``members``/``epochs``: (first step,
    value) from the logged sequence), and each step's lr is --lr (x its size / ``scale_lr``)."""
    for step in range(last + 1):
        size = len([m for g, m in members if g <= step][-1])
        epoch = [e for g, e in epochs if g <= step][-1]
        lr = LR * size / scale_lr if scale_lr is not None else LR
        seen = {r: (int(h["crcs"][step - int(h["start"])]), int(h["sizes"][step - int(h["start"])]),
                    int(h["epochs"][step - int(h["start"])]), float(h["lrs"][step - int(h["start"])]))
                for r, h in hosts.items() if step >= int(h["start"])}
        if not seen:  # every host of that step died since
            continue
        assert len({crc for crc, _, _, _ in seen.values()}) == 1, f"the live hosts differ at step {step}: {seen}"
        assert all((s, e, l) == (size, epoch, lr) for _, s, e, l in seen.values()), \
            f"at step {step} the logged sequence says size {size}, epoch {epoch}, lr {lr}; the hosts {seen}"
    first = next(iter(hosts.values()))
    for r, h in hosts.items():
        assert len(h["crcs"]) == last + 1 - int(h["start"]), (r, len(h["crcs"]), last)
        for name in (k for k in first.files if k.startswith("param.")):
            assert h[name].tobytes() == first[name].tobytes(), f"worker {r}'s {name} differs"
    return last


def compare(cluster_class, chaos, args, out, steps):
    """The churned run's final loss and average membership beside undisturbed runs'."""
    import mnist_replay  # torch: not for the synthetic task's loop
    sequence = membership_sequence(chaos)
    per_step = mnist_replay.members_by_step(sequence, steps)
    average = float(np.mean([len(m) for m in per_step]))  # by steps, not by seconds
    rank, name = next(iter(chaos.live.items()))
    churned = np.load(os.path.join(out, f"rank{rank}.{chaos.start_of(name)}.npz"))
    workers = max(1, int(round(average)))
    baseline = []
    for seed in range(args.baseline_seeds):
        folder = os.path.join(out, f"undisturbed{seed}")
        os.makedirs(folder, exist_ok=True)
        c = cluster_class(workers, args.servers, folder, args.heartbeat_timeout,
                          worker_command(folder, None, seed, steps, args.scale_lr))
        try:
            c.wait_for(f"the undisturbed run (seed {seed}) to end", lambda: all(
                p.poll() is not None for p in c.procs.values()), BASELINE_BOUND)
        finally:
            c.kill_all()
        failed = {n: p.returncode for n, p in c.procs.items() if p.returncode != 0}
        assert not failed, f"the undisturbed run failed: {failed}\n{c.report(list(failed))}"
        done = np.load(os.path.join(folder, "rank0.0.npz"))
        baseline.append((float(done["loss"]), float(done["val_loss"])))
        print(f"undisturbed run, {workers} hosts, seed {seed}: final loss {baseline[-1][0]:.4f}, held-out "
              f"{baseline[-1][1]:.4f}", flush=True)
    replayed = mnist_replay.losses(per_step, args.baseline_seeds, scale_lr=args.scale_lr)
    print(f"the churned run's membership replayed in one process: final and held-out losses {replayed}", flush=True)
    return {"model_seed": args.model_seed, "loss": float(churned["loss"]), "val_loss": float(churned["val_loss"]),
            "average_members": round(average, 2), "scale_lr": args.scale_lr,
            "undisturbed_workers": workers, "undisturbed_losses": [b[0] for b in baseline],
            "undisturbed_val_losses": [b[1] for b in baseline], "replayed_losses": [r[0] for r in replayed],
            "replayed_val_losses": [r[1] for r in replayed], "sequence": sequence, "steps": steps}


def membership_sequence(chaos):
    """[(first step, members)] of the churned run, from the scheduler's log."""
    from chaos_elastic import events_of
    return [(0, list(range(chaos.args.workers)))] + [(g, list(m)) for _, _, _, g, m in
                                                     events_of(chaos.cluster.text("scheduler"))]


def line(result):
    if not result:
        return ""

    def spread(values):
        return f"{', '.join(f'{x:.4f}' for x in values)} (mean {np.mean(values):.4f}, spread {np.std(values):.4f})"

    held = result["undisturbed_val_losses"]
    off = (f": the churned held-out loss is {(result['val_loss'] - np.mean(held)) / np.std(held):+.1f} spreads "
           "from their mean" if len(held) > 1 and np.std(held) > 0 else " (one run: no spread)")
    return (f"; {lr_rule(result.get('scale_lr'))} (every run); model seed {result['model_seed']}: final loss "
            f"{result['loss']:.4f}, held-out {result['val_loss']:.4f} (average membership by steps "
            f"{result['average_members']}); undisturbed {result['undisturbed_workers']} hosts: final "
            f"{spread(result['undisturbed_losses'])}, held-out {spread(held)}{off}; its membership replayed in "
            f"one process: final {spread(result['replayed_losses'])}, held-out {spread(result['replayed_val_losses'])}")
