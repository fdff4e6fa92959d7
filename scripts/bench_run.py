"""bench_pushpull: running every configuration of one link and rank count, interleaved pass
after pass: the torch.distributed block (torch's rows and bps_gc collective, one process per
rank running all its rows), bps_gc on the parameter server and ps-lite, per server placement."""
import os
import statistics
import sys
import time
from types import SimpleNamespace

from bench_cluster import ClusterFailed, bps_plan, log_tail, mx_plan, run_cluster
from bench_common import CONFIG_ENV, ONE_HOST_ONLY, cpu_counters
from bench_report import collective_rows, load_results, summarize

COLLECTIVE = ("collective", "all rows", "torch.distributed")


def machine_busy(seconds=1.0):
    """Fraction of all CPUs busy over the next ``seconds`` (None if /proc/stat is unreadable)."""
    before = cpu_counters()[0]
    time.sleep(seconds)
    after = cpu_counters()[0]
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def wait_until_idle(max_wait, threshold=0.25):
    """Wait (at most max_wait s) until other processes leave the CPUs mostly idle: timings on a
    shared 2-CPU machine mean little otherwise. Returns (seconds waited, last busy fraction)."""
    start = time.monotonic()
    busy = machine_busy()
    while busy is not None and busy > threshold and time.monotonic() - start < max_wait:
        busy = machine_busy()
    return time.monotonic() - start, busy


def config_timeout(args, shaped, rows=1):
    if args.timeout:
        return args.timeout * rows
    if not shaped:
        return 300.0 * rows
    # dense: each NIC carries about 2 x 102 MB each way per round; allow 2x that per round
    per_round = 2 * 2 * 102.2e6 * 8 / args.rate_bits
    return (180 + (args.warmup + args.rounds + 2) * per_round * 2) * rows


def run_one(key, topo, args, children, result_dir, timeout, say):
    """One cluster for one configuration (or the whole collective block): (results, info)."""
    system, config, placement = key
    os.makedirs(result_dir)
    if system == "collective":
        from bench_collective import rank_plan
        raw = os.path.join(result_dir, "collective.json")
        opts = SimpleNamespace(warmup=args.warmup, rounds=args.rounds, tensors=args.tensors,
                               elements=args.elements, rows=args.collective_rows)
        plan, workers = rank_plan(topo, args.ranks, raw, opts, args.local_ranks)
    elif system == "bps_gc PS":
        plan, workers = bps_plan(config, topo, args, result_dir, args.rounds, args.warmup,
                                 args.ranks, placement)
    else:
        plan, workers = mx_plan(config, topo, args, result_dir, args.rounds, args.warmup,
                                args.ranks, placement)
    info = {"busy_before": None, "waited_idle_seconds": 0.0}
    if args.wait_idle > 0:
        waited, busy = wait_until_idle(args.wait_idle)
        info.update(busy_before=busy, waited_idle_seconds=waited)
        if busy is not None and busy > 0.25:
            say(f"{system} {config}: machine still {100 * busy:.0f}% busy after waiting "
                f"{waited:.0f} s for other processes; measuring anyway")
    t0 = time.monotonic()
    try:
        _, note = run_cluster(children, plan, workers, timeout, result_dir)
        if system == "collective":
            results = collective_rows(os.path.join(result_dir, "collective.json"))
        else:
            results = load_results(result_dir, "bps" if system == "bps_gc PS" else "mx",
                                   args.ranks * args.local_ranks)
    except ClusterFailed as e:
        started = e.args[1] if len(e.args) > 1 else []
        say(f"{system} {config}: FAILED: {e.args[0]} (logs in {result_dir})")
        for c in started:
            tail = log_tail(c)
            if tail.strip():
                say(f"--- {c.name} (last lines)\n{tail.rstrip()}")
        raise
    info["wall_seconds"] = time.monotonic() - t0
    if note:
        info["note"] = note
        say(f"{system} {config}: note: {note}")
    profile = os.path.join(result_dir, "server-profile.txt")
    if os.path.exists(profile):
        with open(profile) as f:
            info["server_profile"] = f.read()
    if system == "collective":
        for label, r in results.items():
            say(f"{label}: {r['median_s']:.3f} s/round")
    else:
        med = statistics.median(r["seconds"] for r in results[0]["rounds"])
        extra = f", check {results[0]['check']}" if results[0].get("check") else ""
        say(f"{system} {config} ({placement}): {med:.3f} s/round{extra}")
    return results, info


def work_list(args):
    keys = [COLLECTIVE] if args.collective_rows != "none" else []
    for placement in args.placements:
        keys += [("ps-lite", c, placement) for c in args.mx]
        keys += [("bps_gc PS", c, placement) for c in args.bps]
    return keys


def run_all(args, topo, children, log_root):
    """Every configuration, --passes times interleaved (load from other jobs on the machine then
    hits each alike); returns the table's rows."""
    shaped = topo.name != "loopback"
    keys = work_list(args)
    runs = {key: [] for key in keys}
    infos = {key: [] for key in keys}
    errors = {}
    from tqdm import tqdm
    work = [(p, key) for p in range(args.passes) for key in keys]
    bar = tqdm(work, desc=f"{topo.name}, {topology_name(args)}", unit="config", file=sys.stderr)
    for p, key in bar:
        bar.set_postfix_str(" ".join(key[:2]) + (f" (pass {p + 1})" if args.passes > 1 else ""))
        if key in errors:
            continue
        tag = f"{'-'.join(key)}-{p}".replace(" ", "_").replace("%", "pct").replace("+", "_")
        timeout = config_timeout(args, shaped, rows=20 if key == COLLECTIVE else 1)
        for attempt in (1, 2):  # once more after a failure: a port taken by another job meanwhile
            try:
                results, info = run_one(key, topo, args, children,
                                        os.path.join(log_root, f"{tag}-{attempt}"), timeout, tqdm.write)
                break
            except ClusterFailed as e:
                error = str(e.args[0])
        else:
            errors[key] = error
            args.failed = True
            continue
        runs[key].append(results)
        infos[key].append(info)
    bar.close()
    rows = []
    for key in keys:
        if key in errors:
            rows.append({"system": key[0], "config": key[1], "topology": key[2], "error": errors[key]})
        elif key == COLLECTIVE:
            rows += pooled_collective(runs[key], infos[key], topology_name(args), args.ranks, args.local_ranks)
        elif runs[key]:
            row = summarize(key[0], key[1], runs[key], args.local_ranks)
            row["topology"] = f"{topology_name(args)}, servers {key[2]}"
            row["workers"], row["placement"] = args.ranks, key[2]
            row["machines"], row["local_ranks"] = args.ranks, args.local_ranks
            if key[0] == "bps_gc PS" and args.local_ranks > 1:
                flat = CONFIG_ENV.get(key[1], {}).get("BPS_GC_HIERARCHY") == "flat"
                row["topology"] += ", flat" if flat else ", two levels"
            if key[1] in ONE_HOST_ONLY:  # BPS_GC_LOCAL_REDUCE: the dense sums skip the servers
                row["topology"] = f"{args.ranks} workers summing in shared memory, servers {key[2]} (idle)"
            add_info(row, infos[key])
            if row.get("check") not in (None, "ok"):
                args.failed = True
            rows.append(row)
    return rows


def add_info(row, info):
    row["wall_seconds"] = sum(i["wall_seconds"] for i in info)
    row["busy_before"] = [i["busy_before"] for i in info]
    row["waited_idle_seconds"] = sum(i["waited_idle_seconds"] for i in info)
    notes = [i["note"] for i in info if i.get("note")]
    if notes:
        row["note"] = "; ".join(notes)
    if info and info[0].get("server_profile"):
        row["server_profile"] = info[0]["server_profile"]


def topology_name(args):
    if args.local_ranks > 1:
        return f"{args.ranks} machines x {args.local_ranks} ranks"
    return f"{args.ranks} workers"


def pooled_collective(passes, info, topology, machines, local_ranks):
    """The collective block's rows, each with rank 0's round times of every pass pooled."""
    rows = []
    for label in passes[0]:
        times = [t for results in passes for t in results[label]["times"]]
        med = statistics.median(times)
        if label.startswith("bps_gc collective "):
            system, config = "bps_gc collective", label[len("bps_gc collective "):]
        elif label.startswith("DDP bps_gc hook "):
            system, config = "bps_gc DDP hook", label[len("DDP bps_gc hook "):]
        else:
            system, config = "torch", label
        nic = [(results[label].get("nic_tx_per_round"), results[label].get("nic_rx_per_round")) for results in passes]
        nic = [pair for pair in nic if None not in pair]
        row = {"system": system, "config": config, "topology": topology,
               "seconds": med, "min": min(times), "max": max(times), "times": times,
               "rounds": len(times), "passes": len(passes), "machines": machines, "local_ranks": local_ranks,
               "pass_medians": [results[label]["median_s"] for results in passes],
               "tcp_per_round": passes[0][label].get("tcp_per_round")}
        cpus = [c for results in passes for c in results[label].get("cpus", [])]
        if cpus:  # rank 0's CPU seconds per round, every thread (older bench_collective.py: none)
            row["cpu_s"] = statistics.median(cpus)
        py_cpus = [c for results in passes for c in results[label].get("py_cpus", [])]
        if py_cpus:  # the same of its Python threads alone (bench_collective.py's py_cpu_s)
            row["py_cpu_s"] = statistics.median(py_cpus)
        if nic:  # machine 0's NIC, both directions, per round (as the PS rows' link_*_per_worker)
            row["link_tx_per_worker"] = statistics.fmean(tx for tx, _ in nic)
            row["link_rx_per_worker"] = statistics.fmean(rx for _, rx in nic)
        add_info(row, info)
        rows.append(row)
    return rows
