"""scripts/diloco_quality.py's rows: their keys, the gap to DDP, the table, the verdict at
H = 50, the check against the LM yardstick's JSON, the plot and the merge of several runs."""
import json
import os


def key(kind, replicas, steps, every, outer_lr, inner_lr, momentum=0.9, warm=0, thc_bits=0, warm_every=0):
    return (f"{kind} R={replicas} steps={steps}" + (f" H={every} outer_lr={outer_lr}" if kind == "diloco" else "")
            + (f" inner_lr={inner_lr}" if inner_lr else "")
            + (f" momentum={momentum}" if kind == "diloco" and momentum != 0.9 else "")
            + (f" warm={warm}" if kind == "diloco" and warm else "")
            + (f" thc={thc_bits}" if kind == "diloco" and thc_bits else "")
            + (f" warm_every={warm_every}" if kind == "diloco" and warm_every else ""))


def gaps(results):
    """Each DiLoCo row's final loss against DDP's at the same replicas and length (%)."""
    for row in results.values():
        if row["kind"] == "diloco":
            ddp = results[key("ddp", row["replicas"], row["steps"], None, None, None)]["final"]
            row["ddp_final"], row["gap_pct"] = ddp, 100 * (row["final"] / ddp - 1)
    return results


def codec(row):
    """The pseudo-gradients' exchange of a DiLoCo row: dense float32 or thc's B-bit codes."""
    return f"thc{row['thc_bits']}" if row.get("thc_bits") else "dense"


def exchanges(row):
    """A DiLoCo row's exchanges of the model's size (DDP: one a step): the warm start's (K, or
    K/H0), then one an outer round (a last one where H does not divide the rest)."""
    k, h0 = row.get("warm_start", 0), row.get("warm_every", 0)
    return (k // h0 if h0 else k) + -(-(row["steps"] - k) // row["every"])


def warm(row):
    """A DiLoCo row's warm start: K (DDP's steps first) or K/H0 (plain averaging every H0 steps in them)."""
    k, h0 = row.get("warm_start", 0), row.get("warm_every", 0)
    return f"{k}/{h0}" if h0 else f"{k}"


def check_against_table(path, results):
    """Lines comparing this simulation with a time_to_accuracy.py --task lm run (2 real ranks)."""
    saved = json.load(open(path))
    lines, steps = [], saved["steps"]
    pairs = [("reference", [(s, loss) for s, loss in saved["reference"]["curve"]], key("ddp", 2, steps, None, None, None))]
    for row, bits in (("bps_gc DiLoCo H=50 dense", 0), ("bps_gc DiLoCo H=50 thc 4-bit", 4)):
        if row in saved["curves"]:
            pairs.append((row, [(s, loss) for s, _, loss in saved["curves"][row]], key("diloco", 2, steps, 50, 0.7, None,
                                                                                      thc_bits=bits)))
    for row, theirs, mine in pairs:
        if mine not in results:
            lines.append(f"check: no {mine} row here to compare with the table's {row!r}")
            continue
        here = dict(results[mine]["curve"])
        common = [(s, loss, here[s]) for s, loss in theirs if s in here and 0 < s <= steps]
        worst = max(abs(a - b) / abs(a) for _, a, b in common)
        lines.append(f"check vs {os.path.basename(os.path.dirname(path)) or path} (2 real ranks): {row!r} at steps "
                     + ", ".join(f"{s}: {a:.5f} vs {b:.5f}" for s, a, b in common) + f" here; worst {worst:.1e} relative")
    return lines


def lengths(results):
    """[(steps, replicas)] of the DDP rows, in order."""
    return sorted({(x["steps"], x["replicas"]) for x in results.values() if x["kind"] == "ddp"})


def table_lines(results, args):
    lines = [f"{'steps':>5} {'R':>2} {'H':>4} {'outer lr':>8} {'momentum':>8} {'inner lr':>8} {'warm':>6} {'pg':>5} {'val loss':>9} "
             f"{'DDP':>7} {'gap':>7} {'exch':>6} {'s':>6}"]
    for s, r in lengths(results):
        ddp = results[key("ddp", r, s, None, None, None)]
        lines.append(f"{s:5d} {r:2d} {'DDP':>4} {'':8} {'':8} {args.lr:8.1e} {'':6} {'':5} {ddp['final']:9.4f} {'':7} {'':7} "
                     f"{'100%':>6} {ddp['seconds']:6.1f}")
        rows = sorted((x for x in results.values() if x["kind"] == "diloco" and x["replicas"] == r and x["steps"] == s),
                      key=lambda x: (x["every"], x.get("warm_start", 0), -x.get("outer_momentum", 0.9),
                                     x["inner_lr"] or args.lr, x["outer_lr"], x.get("thc_bits", 0)))
        for x in rows:
            lines.append(f"{s:5d} {r:2d} {x['every']:4d} {x['outer_lr']:8.2f} {x.get('outer_momentum', 0.9):8.2f} "
                         f"{x['inner_lr'] or args.lr:8.1e} {warm(x):>6} {codec(x):>5} {x['final']:9.4f} {x['ddp_final']:7.4f} {x['gap_pct']:6.1f}% "
                         f"{100 * exchanges(x) / s:5.1f}% {x['seconds']:6.1f}")
    return lines


def verdict_lines(results, args):
    """The best H = 50 setting per (replicas, length) and whether it is within 5% of DDP."""
    lines = []
    for s, r in lengths(results):
        rows = [x for x in results.values() if x["kind"] == "diloco" and x["replicas"] == r and x["steps"] == s
                and x["every"] == 50]
        if rows:
            b = min(rows, key=lambda x: x["final"])
            lines.append(f"best at H=50, R={r}, {s} steps: outer lr {b['outer_lr']}, momentum "
                         f"{b.get('outer_momentum', 0.9)}, warm start {warm(b)}, inner lr {b['inner_lr'] or args.lr:g}, {codec(b)}: "
                         f"{b['final']:.4f} vs DDP {b['ddp_final']:.4f}, {b['gap_pct']:+.1f}% "
                         f"({'within' if b['gap_pct'] <= 5 else 'NOT within'} 5%)")
    return lines


def plot(path, results, args):
    """Gap to DDP vs H, one line per (outer momentum, warm start, replicas, length), each point at
    its best outer lr (inner lr --lr)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    swept = [x for x in results.values() if x["kind"] == "diloco" and x["inner_lr"] is None]
    every = sorted({x["every"] for x in swept})
    recipes = sorted({(x.get("outer_momentum", 0.9), x.get("warm_start", 0)) for x in swept}, reverse=True)
    for i, (momentum, warm) in enumerate(recipes):
        for s, r in lengths(results):
            points = []
            for h in every:
                rows = [x for x in swept if (x.get("outer_momentum", 0.9), x.get("warm_start", 0)) == (momentum, warm)
                        and x["replicas"] == r and x["steps"] == s and x["every"] == h]
                if rows:
                    points.append((h, min(x["gap_pct"] for x in rows)))
            if len(points) > 1:
                ax.plot(*zip(*points), ("-", "--", ":", "-.")[i % 4], marker="o", label=f"R={r}, {s} steps, outer "
                        f"momentum {momentum}" + (f", {warm} DDP steps first" if warm else ""))
    ax.axhline(5, color="grey", linestyle=":", label="5% (issue 44's target)")
    ax.set_xscale("log")
    ax.set_xticks(every, [str(h) for h in every])
    ax.minorticks_off()
    ax.set_xlabel("H (inner steps between outer rounds)")
    ax.set_ylabel("final val loss vs DDP at equal tokens (%)")
    ax.set_title("DiLoCo on the reduced LM at equal tokens, best outer lr per point", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


def merged(paths):
    """The rows of several runs' JSON files, each keyed with its outer momentum."""
    results, heads = {}, []
    for path in paths:
        saved = json.load(open(path))
        if "settings" not in saved:  # an earlier --report's merged file: its runs are given too
            continue
        heads.append(f"{path}: {' '.join(saved['command'][1:]) or '(defaults)'}; {saved['uptime']}")
        heads += [line for line in saved["lines"] if line.startswith("check")]
        for row in saved["rows"].values():
            if row["kind"] == "diloco":
                row.setdefault("outer_momentum", saved["settings"]["outer_momentum"])
            results[key(row["kind"], row["replicas"], row["steps"], row["every"], row["outer_lr"], row["inner_lr"],
                        0.9 if row.get("outer_momentum") is None else row["outer_momentum"],
                        row.get("warm_start", 0), row.get("thc_bits", 0), row.get("warm_every", 0))] = row
    return results, heads
