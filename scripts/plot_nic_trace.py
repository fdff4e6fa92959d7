#!/usr/bin/env python3
"""Plot what each machine's NIC sent and received, round by round, from a bench_pushpull run
made with BENCH_TRACE=PREFIX (bps_gc parameter-server rows on a --shaped link): one panel per
machine, Mbit/s in 100 ms bins against seconds, the rounds shaded. Prints each round's time
and each NIC's mean use of it.

    BENCH_TRACE=out/trace/t python scripts/bench_pushpull.py --ranks 2 --shaped 100mbit \\
        --configs dense --pslite none --collective-rows all_reduce --rounds 5
    python scripts/plot_nic_trace.py out/trace/t.dense --out out/trace/nic.png
"""
import argparse
import glob
import json
import sys

BIN = 0.1  # seconds


def load(prefix):
    paths = sorted(glob.glob(f"{prefix}.w*.json"), key=lambda p: int(p.rsplit(".w", 1)[1][:-5]))
    if not paths:
        sys.exit(f"plot_nic_trace: no {prefix}.w<rank>.json files (run with BENCH_TRACE={prefix.rsplit('.', 1)[0]})")
    return [json.load(open(p)) for p in paths]


def rates(samples, t0, column):
    """(bin start, Mbit/s) from cumulative byte counters."""
    out, start = [], 0
    for i in range(1, len(samples)):
        if samples[i][0] - samples[start][0] >= BIN:
            dt = samples[i][0] - samples[start][0]
            out.append((samples[start][0] - t0, (samples[i][column] - samples[start][column]) * 8 / dt / 1e6))
            start = i
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="PREFIX.<config> as written by the workers")
    ap.add_argument("--out", default=None, help="PNG path (default: PREFIX.<config>.png)")
    args = ap.parse_args(argv)
    traces = load(args.prefix)
    t0 = min(t["marks"][0][0] for t in traces)
    for rank, t in enumerate(traces):
        spans = list(zip(t["marks"][::2], t["marks"][1::2]))
        cells = []
        for start, end in spans:
            inside = [s for s in t["samples"] if start[0] <= s[0] <= end[0]]
            if len(inside) < 2:
                continue
            dt = inside[-1][0] - inside[0][0]
            tx, rx = ((inside[-1][c] - inside[0][c]) * 8 / dt / 1e6 for c in (1, 2))
            cells.append(f"{end[0] - start[0]:.2f} s (tx {tx:.0f}, rx {rx:.0f} Mbit/s)")
        print(f"machine {rank}: " + "; ".join(cells))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.2 * len(traces)), sharex=True, squeeze=False)
    for rank, (t, ax) in enumerate(zip(traces, axes[:, 0])):
        for column, label in ((1, "sent"), (2, "received")):
            points = rates(t["samples"], t0, column)  # none when the trace is shorter than a bin
            ax.plot([x for x, _ in points], [y for _, y in points], label=label, lw=1)
        for start, end in zip(t["marks"][::2], t["marks"][1::2]):
            ax.axvspan(start[0] - t0, end[0] - t0, color="0.9", zorder=0)
        ax.set_ylabel(f"machine {rank}\nMbit/s")
        ax.legend(loc="lower right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds (grey: worker's timed rounds)")
    fig.suptitle(f"NIC use per machine: {args.prefix}")
    fig.tight_layout()
    out = args.out or f"{args.prefix}.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
