"""DiLoCo settings against the LM yardstick's time target (issue 44, docs/diloco_time.md), searched
cheaply in one process: scripts/diloco_quality.py's replicas (bit for bit bps_gc.torch.DiLoCo's
arithmetic), with the schedule of a `time_to_accuracy.py --task lm --steps S` run (the cosine
ends at S, the floor after it, as that table's rows past --steps), report for each setting the
first outer round whose global copy is at or below the table's target, the step the table's
evaluation (every --eval-every steps) would see it at, the exchanges of the model up to there
(warm averages and outer rounds) and an estimate of its time on the 10 Mbit/s table:
steps x --step-ms + exchanges x --exchange-ms (the table's compute-only step; one thc 4-bit
exchange of the reduced GPT there).

    .venv/bin/python scripts/diloco_time_search.py --run 200 --setting 25,1.0,0.9,100,20,4,
    # --setting H,outer lr,outer momentum,warm steps,warm every,thc bits,inner peak lr ('': --lr); repeatable

2 replicas; the model and data flags are diloco_quality.py's (the reduced GPT by default).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diloco_quality  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", action="append", required=True, metavar="H,LR,M,W,W0,B,ILR")
    p.add_argument("--schedule", type=int, default=150, help="the table's --steps: the cosine's end")
    p.add_argument("--run", type=int, default=200, help="inner steps of each setting")
    p.add_argument("--target", type=float, default=2.5469, help="the table's target (nats per byte)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--step-ms", type=float, default=14.5)
    p.add_argument("--exchange-ms", type=float, default=66.0)
    p.add_argument("--limit-s", type=float, default=2.175, help="the limit row's seconds (its x limit)")
    ours, rest = p.parse_known_args(argv)
    return ours, diloco_quality.parse_args(rest + ["--plot", ""])


def main(argv=None):
    ours, args = parse(argv)
    study = diloco_quality.Study(args)
    run = study.settings
    study.settings = lambda steps, inner_lr=None: argparse.Namespace(**{**vars(run(steps, inner_lr)), "steps": ours.schedule})
    print(f"{'H,outer lr,momentum,warm,warm every,thc bits,inner lr':52} {'round':>5} {'seen':>5} {'exch':>4} "
          f"{'est s':>6} {'x limit':>7} {'loss @ schedule end':>19} {'loss @ run':>10} {'s':>4}")
    for setting in ours.setting:
        h, lr, momentum, warm, warm_every, bits, inner = setting.split(",")
        began = time.perf_counter()
        curve = study.diloco(2, ours.run, int(h), float(lr), float(momentum), float(inner) if inner else None,
                             int(warm), int(bits), int(warm_every))
        # the study's last round at --run where H does not divide it is not the table's: not counted
        hit = next((s for s, loss in curve if 0 < s < ours.run and loss <= ours.target), None)
        at_end = [loss for s, loss in curve if s <= ours.schedule][-1]
        if hit:
            seen = -(-hit // ours.eval_every) * ours.eval_every
            exchanges = sum(1 for s, _ in curve if 0 < s <= hit)
            est = seen * ours.step_ms / 1000 + exchanges * ours.exchange_ms / 1000
            cols = f"{hit:5d} {seen:5d} {exchanges:4d} {est:6.2f} {est / ours.limit_s:6.2f}x"
        else:
            cols = f"{'-':>5} {'-':>5} {'-':>4} {'-':>6} {'-':>7}"
        print(f"{setting:52} {cols} {at_end:19.4f} {curve[-1][1]:10.4f} {time.perf_counter() - began:4.0f}", flush=True)


if __name__ == "__main__":
    main()
