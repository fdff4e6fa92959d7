"""bench_pushpull: summarizing the workers' results and printing the table."""
import json
import os
import statistics


from bench_cluster import ClusterFailed
from bench_common import BPS_TARGETS, PSLITE_REFERENCE


def summarize(system, config, passes):
    """One row from the workers' JSON results of every pass: worker 0's round times (all passes
    pooled), byte counts, CPU and link counters."""
    w0s = [results[0] for results in passes]
    rounds0 = [r for w in w0s for r in w["rounds"]]
    times = [r["seconds"] for r in rounds0]
    med = statistics.median(times)

    def mean(key):
        return statistics.fmean(r.get(key, 0) or 0 for r in rounds0)

    checks = [w.get("check") for w in w0s]
    row = {"system": system, "config": config, "seconds": med, "min": min(times),
           "max": max(times), "times": times, "rounds": len(times), "passes": len(passes),
           "pass_medians": [statistics.median(r["seconds"] for r in w["rounds"]) for w in w0s],
           "pushed_raw": mean("pushed_raw"), "pulled_raw": mean("pulled_raw"),
           "gbps_per_worker": mean("pushed_raw") / med / 1e9,
           "check": next((c for c in checks if c not in (None, "ok")), checks[0]),
           "setup_seconds": w0s[0].get("setup_seconds"),
           "worker1_seconds": statistics.median(r["seconds"] for results in passes
                                                for r in results[1]["rounds"])}
    if system == "bps_gc":
        row.update(pushed_wire=mean("pushed_wire"), pulled_wire=mean("pulled_wire"),
                   issue_seconds=mean("issue_seconds"), compress_seconds=mean("compress_seconds"),
                   communicate_seconds=mean("communicate_seconds"),
                   wait_seconds=mean("wait_seconds"))
    else:
        row.update(pushed_wire=None, pulled_wire=None)
    busy = [(w.get("cpu") or {}).get("machine_busy") for w in w0s]
    busy = [b for b in busy if b is not None]
    row["machine_busy"] = statistics.fmean(busy) if busy else None
    row["worker_cpu_per_round"] = []
    for rank in range(2):
        cpu = [(results[rank].get("cpu") or {}).get("process_cpu_per_round") for results in passes]
        cpu = [c for c in cpu if c is not None]
        row["worker_cpu_per_round"].append(statistics.fmean(cpu) if cpu else None)
    links = [w["link"] for w in w0s if w.get("link")]
    if links and len(links) == len(w0s):
        n = len(times) * 2  # both workers share the veth
        row["link_tx_per_worker"] = sum(link["tx_bytes"] for link in links) / n
        row["link_rx_per_worker"] = sum(link["rx_bytes"] for link in links) / n
    if w0s[0].get("profile"):
        row["worker0_profile"] = w0s[0]["profile"]
    return row


def load_results(result_dir, prefix):
    out = []
    for rank in range(2):
        path = os.path.join(result_dir, f"{prefix}-w{rank}.json")
        if not os.path.exists(path):
            raise ClusterFailed(f"worker rank {rank} wrote no result ({path})", [])
        with open(path) as f:
            out.append(json.load(f))
    return out


def fmt_mb(value):
    return "-" if value is None else f"{value / 1e6:.2f}"


def verdict(row, dense_pslite, topo_name):
    """(target text, ok/MISS/'') for a row."""
    if row.get("error"):
        return "", ""
    if row["system"] == "ps-lite":
        ref = PSLITE_REFERENCE.get(topo_name, {}).get(row["config"])
        return (f"ref {ref:g} s (issue)", "") if ref else ("", "")
    targets = []
    if row["config"] == "dense" and dense_pslite:
        ok = row["seconds"] <= dense_pslite
        targets.append((f"<= ps-lite {dense_pslite:.3f} s", ok))
    limit = BPS_TARGETS.get(topo_name, {}).get(row["config"])
    if limit is not None:
        targets.append((f"<= {limit:g} s", row["seconds"] <= limit))
    if not targets:
        return "", ""
    return "; ".join(t for t, _ in targets), "ok" if all(ok for _, ok in targets) else "MISS"


def print_table(title, rows, topo_name, shaped):
    dense = next((r["seconds"] for r in rows if r["system"] == "ps-lite" and r["config"] == "dense"
                  and not r.get("error")), None)
    head = ["system", "config", "s/round", "min", "max", "push MB/w", "pull MB/w"]
    if shaped:
        head.append("link MB/w")
    head += ["GB/s/w", "CPU%", "w CPU s", "vs ps-lite", "target", ""]
    lines = []
    for r in rows:
        if r.get("error"):
            cells = [r["system"], r["config"], "FAILED", "", "", "", ""] + ([""] if shaped else []) \
                + ["", "", "", "", r["error"][:60], ""]
            lines.append(cells)
            continue
        target, ok = verdict(r, dense, topo_name)
        cells = [r["system"], r["config"], f"{r['seconds']:.3f}", f"{r['min']:.3f}",
                 f"{r['max']:.3f}", fmt_mb(r["pushed_wire"]), fmt_mb(r["pulled_wire"])]
        if shaped:
            link = r.get("link_tx_per_worker")
            cells.append("-" if link is None else fmt_mb(link + r["link_rx_per_worker"]))
        busy = r.get("machine_busy")
        wcpu = [c for c in r.get("worker_cpu_per_round") or [] if c is not None]
        cells += [f"{r['gbps_per_worker']:.3f}", "-" if busy is None else f"{100 * busy:.0f}",
                  "/".join(f"{c:.3f}" for c in wcpu) or "-",
                  f"{r['seconds'] / dense:.2f}" if dense else "-", target, ok]
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    out = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
    text = "\n".join(out)
    print(text, flush=True)
    return text


