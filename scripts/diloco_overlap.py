#!/usr/bin/env python3
"""Streaming DiLoCo's overlap (issue 44's target: with F = 4 and tau = 1 at 10 Mbit/s, the mean
inner step within 1.1x of the compute-only step): the mean inner step time with the exchange in
flight against plain AdamW steps, and where the difference goes.

Two ranks (torch.distributed, gloo; on loopback, or with --shaped RATE one network namespace
per rank with its NIC shaped, as scripts/time_to_accuracy.py --shaped, root) train the LM
yardstick's reduced GPT (2 layers x 64, context 64, batch 16 per rank, random bytes) in one
process per rank, every row its own model from the same seed, the rows taking turns in blocks
of H inner steps (so a change in the box's load falls on every row alike). A DiLoCo row's blocks
start one step past a multiple of H, where no exchange is in flight (F = 4, tau = 1: fragments
start at steps 12, 25, 37, 50 mod 50 and are applied one step later), so no exchange is hidden
behind another row's block. Columns: the mean and median step; ``x compute``, the mean against
compute-only's; ``paired``, the median over rounds of a block's mean against the compute-only
block of the same round (the other jobs on the box come and go over seconds); ``slower``, the
same against the compute-only block's slower rank (ranks that sync keep the slower one's pace).
Each step is timed whole (zero_grad, forward, backward, clipping,
step: what the yardstick's clock counts, without its evaluations); the DiLoCo rows' steps
also split into what DiLoCo does on the training thread at a sync: ``start`` (the
pseudo-gradient, handing it to the exchange), ``wait`` (blocked on an exchange not finished at
its due step), ``apply`` (the outer step, the local parameters reset); ``bg cpu``, the CPU
time of the process's other threads (the exchange's, gloo's, the heartbeat's) per step. The
``beside`` and ``alone``: a DiLoCo row's mean step less its
start, wait and apply, for the steps that ran while an exchange was in flight and for the
others (what the exchange's threads take from the training thread: CPU, the GIL). The
second row's ranks meet at a barrier where F=4's fragments start, sending nothing: the drift
between the ranks, which a DiLoCo row waits for too, without its exchange. ``peer late``, how long after
this rank the other rank started the same sync (the ranks drift apart between syncs as the
box's load falls on one; a sync's wait is mostly that). The last row waits for the exchange in
flight every 25 steps inside the timed step, as scripts/time_to_accuracy.py --task lm does
before each evaluation (--eval-every 25): there the exchanges started at steps 25 and 50 of
each window of 50 are waited for whole, not hidden behind the next step.

    .venv/bin/python scripts/diloco_overlap.py                          # loopback
    sudo .venv/bin/python scripts/diloco_overlap.py --shaped 10mbit     # issue 44's link
    .venv/bin/python scripts/diloco_overlap.py --yardstick out/runs/tta_lm_10mbit_reduced_cap10/time_to_accuracy.json
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LM = os.path.join(ROOT, "example", "pytorch", "lm")
sys.path[:0] = [ROOT, HERE, LM]
from bench_common import pythonpath  # noqa: E402

from tta_lm_diloco import DILOCO  # noqa: E402  (the yardstick's rows' settings)

COMPUTE = "compute only (AdamW, no exchange)"
# the ranks meet (a barrier, nothing sent) where F=4's fragments start: the drift between the
# ranks that a DiLoCo row waits for, without its exchange (with tau = 1 it meets a step later)
MEETING = "compute only, ranks meeting at F=4's turns"
YARDSTICK_WAITS = 25  # the yardstick's --eval-every: it waits for the exchange in flight before evaluating
# row -> (fragments, delay, compression_params, wait() every so many steps inside the timed step)
ROWS = {COMPUTE: None, MEETING: None, **{f"DiLoCo H={{H}} {name}": (*DILOCO[name], None) for name in ("F=4 tau=1 thc 4-bit", "dense")},
        "DiLoCo H={H} F=4 tau=1 dense": (4, 1, None, None),
        f"DiLoCo H={{H}} F=4 tau=1 thc 4-bit, wait() every {YARDSTICK_WAITS}": (*DILOCO["F=4 tau=1 thc 4-bit"],
                                                                            YARDSTICK_WAITS)}


def timed_diloco(opt):
    """``opt`` (bps_gc.torch.DiLoCo) with its sync's training-thread work timed into opt.spent."""
    spent = opt.spent = {"start": 0.0, "wait": 0.0, "apply": 0.0, "syncs": 0, "starts": []}

    def timing(fn, key):
        def run(*args):
            began = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[key] += time.perf_counter() - began
        return run
    start, finish = opt.start_sync, opt.finish_sync

    def counted_start(fragment):
        spent["syncs"] += 1
        spent["starts"].append(time.perf_counter())  # CLOCK_MONOTONIC: one clock for both ranks of the box
        return timing(start, "start")(fragment)

    def waited(fragment):
        averaged = fragment.averaged
        fragment.averaged = timing(averaged, "wait")
        try:
            began, waited_before = time.perf_counter(), spent["wait"]
            finish(fragment)
            spent["apply"] += time.perf_counter() - began - (spent["wait"] - waited_before)
        finally:
            del fragment.averaged  # the class's method again
    opt.start_sync, opt.finish_sync = counted_start, waited
    return opt


def worker(spec):
    """One rank: every row in turn, blocks of H steps; writes its JSON to spec["out"]/rank<r>.json."""
    import torch
    import torch.distributed

    import bps_gc.torch as bps
    from gpt import GPT, byte_loss
    torch.set_num_threads(1)
    bps.init()  # as the yardstick: the collective communicator, whose waits watch the heartbeat
    rank, every = bps.rank(), spec["sync_every"]
    rows = {}
    for name in spec["rows"]:
        torch.manual_seed(0)
        model = GPT(spec["layers"], spec["width"], spec["heads"], spec["context"])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
        settings, waits = ROWS[name], None
        if settings is not None:
            fragments, delay, compression, waits = settings
            opt = timed_diloco(bps.DiLoCo(model, opt, every, fragments=fragments, delay=delay,
                                          compression_params=compression))
        data = torch.Generator().manual_seed(1000 + rank)
        rows[name] = {"model": model, "opt": opt, "data": data, "times": [], "bg_cpu": 0.0, "waits": waits,
                      "meets": name == MEETING, "steps": 0,
                      "beside": [], "alone": []}
    turns = {(f + 1) * every // 4 % every for f in range(4)}

    def step(row):
        tokens = torch.randint(0, 256, (spec["batch_size"], spec["context"] + 1), generator=row["data"])
        spent = getattr(row["opt"], "spent", None)
        in_flight = spent is not None and any(f.pending is not None for f in row["opt"].fragments)
        before = 0.0 if spent is None else spent["start"] + spent["wait"] + spent["apply"]
        began = time.perf_counter()
        row["opt"].zero_grad()
        byte_loss(row["model"](tokens[:, :-1]), tokens[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(row["model"].parameters(), 1.0)
        row["opt"].step()
        if row["waits"] and row["opt"].steps % row["waits"] == 0:  # as the yardstick does before evaluating
            row["opt"].wait()
        row["steps"] += 1
        if row["meets"] and row["steps"] % every in turns:
            torch.distributed.barrier()
        took = time.perf_counter() - began
        if spent is not None and not row["waits"]:  # the step less DiLoCo's own work: beside an exchange or not
            row["beside" if in_flight else "alone"].append(took - (spent["start"] + spent["wait"] + spent["apply"]
                                                                  - before))
        return took

    for row in rows.values():  # untimed: the warm-up, and the DiLoCo rows one step past a multiple of H
        for _ in range(every + 1):
            step(row)
        if hasattr(row["opt"], "spent"):
            row["opt"].spent.update(start=0.0, wait=0.0, apply=0.0, syncs=0, starts=[])
    for block in range(spec["blocks"]):
        for row in rows.values():
            bps.barrier()  # both ranks start the block together, as training ranks run
            cpu, mine = time.process_time(), time.thread_time()
            if not row["times"]:  # the warm-up's steps are not counted
                row["beside"], row["alone"] = [], []
            row["times"] += [step(row) for _ in range(every)]
            row["bg_cpu"] += (time.process_time() - cpu) - (time.thread_time() - mine)
        if rank == 0:  # the driver's progress bar reads it in this rank's log
            print(f"{block_name(block)}: {len(rows)} rows", flush=True)
    out = {}
    for name, row in rows.items():
        spent = getattr(row["opt"], "spent", None)
        out[name] = {"step_seconds": row["times"], "background_cpu_seconds": row["bg_cpu"], "spent": spent,
                     "beside": row["beside"], "alone": row["alone"]}
        if spent is not None:
            row["opt"].wait()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    bps.shutdown()


def block_name(block):
    """What rank 0 prints as block ``block`` of every row ends (the driver's progress bar)."""
    return f"block {block + 1}"


def launch(args, spec, log_dir):
    """Both ranks' results: [rank 0's, rank 1's]."""
    from bench_cluster import Children, Loopback, RowsProgress, Switched, child_env, run_or_exit
    from bench_common import import_netns
    net, where = None, "loopback"
    if args.shaped:
        netns = import_netns()
        net = netns.SwitchedMachines(args.shaped, 2).__enter__()
        where = f"{args.shaped} shaped (one namespace per rank; {net.describe()})"
    topo = Switched(net) if net else Loopback()
    spec_path = os.path.join(log_dir, "spec.json")
    json.dump(spec, open(spec_path, "w"))
    children, port = Children(), topo.port()
    plan = [(f"rank{r}", topo.wrap(r, [sys.executable, os.path.abspath(__file__), "--worker", spec_path]),
             child_env({"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": topo.host(0), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                        "GLOO_SOCKET_IFNAME": topo.veth(r) or "lo", "BPS_GC_TRANSPORT": "collective",
                        "PYTHONPATH": pythonpath(ROOT, HERE, LM)})) for r in range(2)]
    progress = RowsProgress([block_name(b) for b in range(spec["blocks"])], "blocks", unit="block")
    progress.follow(os.path.join(log_dir, "rank0.log"))
    try:
        run_or_exit(children, plan, {"rank0", "rank1"}, 1800, log_dir, "diloco_overlap: the job", tick=progress)
    finally:
        progress.close()
        if net is not None:
            net.delete()
    return [json.load(open(os.path.join(spec["out"], f"rank{r}.json"))) for r in range(2)], where


def block_means(ranks, name, every, pool=True):
    """Each block's mean step, in the order they ran: both ranks' steps pooled, or (``pool``
    False) the slower rank's."""
    times = [r[name]["step_seconds"] for r in ranks]
    blocks = range(0, len(times[0]), every)
    if pool:
        return [statistics.fmean(t for mine in times for t in mine[b:b + every]) for b in blocks]
    return [max(statistics.fmean(mine[b:b + every]) for mine in times) for b in blocks]


def table(ranks, every):
    """Rows: the two ranks' step times pooled; per sync, the training thread's DiLoCo work."""
    compute = statistics.fmean(t for r in ranks for t in r[COMPUTE]["step_seconds"])
    compute_blocks, slower_blocks = block_means(ranks, COMPUTE, every), block_means(ranks, COMPUTE, every, False)
    rows = []
    for name in ranks[0]:
        times = [t for r in ranks for t in r[name]["step_seconds"]]
        mean = statistics.fmean(times)
        # each block against the compute-only block of the same round (a second or so apart):
        # the box's other jobs, which come and go over seconds, fall on both alike
        mine = block_means(ranks, name, every)
        paired = [b / c for b, c in zip(mine, compute_blocks)]
        # and against its slower rank's: ranks that sync keep the slower one's pace, where the
        # other jobs take one core at a time (compute-only ranks never wait for each other)
        slower = [b / c for b, c in zip(mine, slower_blocks)]
        row = {"row": name.format(H=every), "steps": len(times), "mean_ms": 1000 * mean,
               "median_ms": 1000 * statistics.median(times), "vs_compute_only": mean / compute,
               "paired_vs_compute_only": statistics.median(paired), "paired_block_ratios": paired,
               "paired_vs_slower_rank": statistics.median(slower), "slower_rank_block_ratios": slower,
               "bg_cpu_ms_per_step": 1000 * sum(r[name]["background_cpu_seconds"] for r in ranks) / len(times)}
        spent = [r[name]["spent"] for r in ranks]
        if spent[0] is not None:
            syncs = sum(s["syncs"] for s in spent)
            for key in ("start", "wait", "apply"):
                row[f"{key}_ms_per_sync"] = 1000 * sum(s[key] for s in spent) / syncs
            row["syncs"] = syncs
            # how long after this rank its peer started the same sync: the part of a wait that is
            # the ranks' drift since the last sync (the box's load falling on one), not the exchange
            late = [max(pair) - mine for pair in zip(*(s["starts"] for s in spent)) for mine in pair]
            row["peer_late_ms_per_sync"] = 1000 * statistics.fmean(late)
            beside, alone = ([t for r in ranks for t in r[name][key]] for key in ("beside", "alone"))
            if beside and alone:  # the training thread's step, less DiLoCo's work, with an exchange running or not
                row["beside_exchange_ms"], row["alone_ms"] = 1000 * statistics.fmean(beside), 1000 * statistics.fmean(alone)
        rows.append(row)
    return rows


def yardstick_intervals(path):
    """The yardstick's own clock read back (``--yardstick``: a time_to_accuracy.py --task lm
    JSON): each DiLoCo row's ms per step over its evaluation intervals with no sync started in
    them and with one or more, against the limit's compute-only step (the median of each rank's
    own forward, backward and optimizer step; the rows' clock is the mean of whole steps)."""
    saved = json.load(open(path))
    print(f"{path}: {saved['link']}")
    print(f"the limit's compute-only step: {1000 * saved['compute_seconds_per_step']:.1f} ms")
    print(f"{'':40} {'no sync':>12} {'with syncs':>12}  (ms per step, mean over intervals; intervals)")
    for name, curve in saved["curves"].items():
        found = re.search(r"H=(\d+)", name)
        if "DiLoCo" not in name or not found:
            continue
        every, fragments = int(found.group(1)), 4 if "F=4" in name else 1
        turns = {(f + 1) * every // fragments % every for f in range(fragments)}
        split = {False: [], True: []}
        for (s0, t0, _), (s1, t1, _) in zip(curve, curve[1:]):
            split[any(k % every in turns for k in range(s0 + 1, s1 + 1))].append(1000 * (t1 - t0) / (s1 - s0))
        cells = [f"{statistics.fmean(v):7.1f} ({len(v):2d})" if v else f"{'-':>12}" for v in (split[False], split[True])]
        print(f"{name:40} {cells[0]} {cells[1]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--shaped", metavar="RATE", help="one namespace per rank, NICs shaped to RATE (root)")
    p.add_argument("--sync-every", type=int, default=50, metavar="H")
    p.add_argument("--blocks", type=int, default=8, help="timed blocks of H steps per row")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "diloco_overlap.json"))
    p.add_argument("--yardstick", metavar="JSON", help="read a time_to_accuracy.py --task lm JSON instead: its "
                   "DiLoCo rows' ms per step over intervals with and without a sync")
    args = p.parse_args()
    if args.worker:
        return worker(json.load(open(args.worker)))
    if args.yardstick:
        return yardstick_intervals(args.yardstick)
    if args.sync_every < 8 or args.blocks < 1 or args.batch_size < 1:
        p.error("--sync-every must be >= 8 (F=4, tau=1), --blocks and --batch-size >= 1")
    from bench_common import machine_info
    with tempfile.TemporaryDirectory(prefix="diloco-overlap-") as tmp:
        spec = {"rows": list(ROWS), "sync_every": args.sync_every, "blocks": args.blocks, "out": tmp,
                "batch_size": args.batch_size, "layers": 2, "width": 64, "heads": 4, "context": 64}
        load = os.getloadavg()[0]
        ranks, where = launch(args, spec, tmp)
    rows = table(ranks, args.sync_every)
    print(f"2 ranks, {where}; {machine_info()}; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} "
          f"at the end; reduced GPT (2 x 64, context 64), batch {args.batch_size}; {args.blocks} blocks of "
          f"{args.sync_every} steps per row and rank, the rows taking turns")
    print(f"{'':50} {'mean ms':>8} {'median':>7} {'x compute':>9} {'paired':>6} {'slower':>6} {'bg cpu':>6} {'syncs':>5} {'start':>8} {'wait':>8} "
          f"{'apply':>8} {'peer late':>9}  (ms per sync) {'beside':>7} {'alone':>6}")
    for r in rows:
        extra = "" if "syncs" not in r else (f" {r['syncs']:5d} {r['start_ms_per_sync']:8.2f} {r['wait_ms_per_sync']:8.2f} "
                                             f"{r['apply_ms_per_sync']:8.2f} {r['peer_late_ms_per_sync']:9.2f}"
                                             + (f"{'':15} {r['beside_exchange_ms']:7.2f} {r['alone_ms']:6.2f}"
                                                if "alone_ms" in r else ""))
        print(f"{r['row']:50} {r['mean_ms']:8.2f} {r['median_ms']:7.2f} {r['vs_compute_only']:8.2f}x {r['paired_vs_compute_only']:5.2f}x {r['paired_vs_slower_rank']:5.2f}x {r['bg_cpu_ms_per_step']:6.2f}{extra}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    json.dump({"machine": machine_info(), "link": where, "command": sys.argv, "load_average_start": load,
               "rows": rows, "step_seconds": {name.format(H=args.sync_every): [r[name]["step_seconds"] for r in ranks]
                                              for name in ranks[0]}}, open(args.out, "w"), indent=1)
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
