"""bench_pushpull: summarizing the workers' results and printing the table."""
import json
import os
import statistics


from bench_cluster import ClusterFailed
from bench_common import import_netns

# A full TCP segment on the benchmark's veths (MTU 1500, timestamps on): 1448 bytes of payload
# in 1514 bytes that tbf charges (Ethernet, IP and TCP headers).
SEGMENT_PAYLOAD, SEGMENT_BYTES = 1448, 1514


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
    if system == "bps_gc PS":
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
    for rank in range(len(passes[0])):
        cpu = [(results[rank].get("cpu") or {}).get("process_cpu_per_round") for results in passes]
        cpu = [c for c in cpu if c is not None]
        row["worker_cpu_per_round"].append(statistics.fmean(cpu) if cpu else None)
    links = [w["link"] for w in w0s if w.get("link")]
    if links and len(links) == len(w0s):
        n = len(times)  # worker 0's machine's NIC (its co-located server's traffic included)
        row["link_tx_per_worker"] = sum(link["tx_bytes"] for link in links) / n
        row["link_rx_per_worker"] = sum(link["rx_bytes"] for link in links) / n
        row["tcp_per_round"] = {k: sum(link["tcp"].get(k, 0) for link in links) / n for k in links[0]["tcp"]}
    if w0s[0].get("profile"):
        row["worker0_profile"] = w0s[0]["profile"]
    return row


def load_results(result_dir, prefix, workers):
    out = []
    for rank in range(workers):
        path = os.path.join(result_dir, f"{prefix}-w{rank}.json")
        if not os.path.exists(path):
            raise ClusterFailed(f"worker rank {rank} wrote no result ({path})", [])
        with open(path) as f:
            out.append(json.load(f))
    return out


def collective_rows(path):
    """bench_collective's rank 0 results: label -> {median_s, min_s, max_s, times}."""
    if not os.path.exists(path):
        raise ClusterFailed(f"rank 0 of the collective block wrote no result ({path})", [])
    with open(path) as f:
        return {r["row"]: r for r in json.load(f)}


def link_floor(row, topo_name):
    """Seconds a worker machine's NIC needs per round, at the shaped rate in full segments, for
    the payload a dense row must move through it (its busier direction): a co-located server
    and a ring all_reduce both send 2 x (N-1)/N of the gradient each way, a worker whose servers
    are on other machines the gradient once. No schedule of those bytes can take less. None on
    loopback or for rows that are not the parameter server's."""
    placement, workers, grad = row.get("placement"), row.get("workers"), row.get("pushed_wire")
    if topo_name == "loopback" or placement is None or not workers or not grad:
        return None
    nic = 2 * (workers - 1) / workers * grad if placement == "colocated" else grad
    return nic * SEGMENT_BYTES / SEGMENT_PAYLOAD * 8 / import_netns().parse_rate(topo_name)


def fmt_mb(value):
    return "-" if value is None else f"{value / 1e6:.2f}"


def find(rows, system, config):
    return next((r for r in rows if r["system"] == system and r["config"] == config
                 and not r.get("error")), None)


BEST_CODEC_LIMIT = {"loopback": 1.0, "1gbit": 0.8}  # issue 12: best codec / DDP PowerSGD rank 1


DENSE = ("dense", "dense (local reduce)", "dense (host's TCP congestion control)")  # not codecs

def targets(rows, topo_name):
    """The issue's targets as [(what, ratio or None, limit or None, verdict)]."""
    out = []
    gloo = find(rows, "torch", "torch all_reduce dense")
    for r in rows:
        if r["system"] == "bps_gc PS" and r["config"] in DENSE and not r.get("error"):
            ratio = r["seconds"] / gloo["seconds"] if gloo else None
            floor = link_floor(r, topo_name)
            bound = f" [line rate for its NIC's bytes: {floor:.3f} s = {floor / gloo['seconds']:.2f}x gloo]" \
                if floor and gloo else ""
            out.append((f"PS {r['config']} ({r['topology']}) / gloo all_reduce{bound}", ratio, 1.0))
    r1 = find(rows, "torch", "DDP PowerSGD rank 1")
    codecs = [r for r in rows if r["system"] in ("bps_gc PS", "bps_gc collective", "bps_gc DDP hook")
              and r["config"] not in DENSE and not r.get("error")]
    if codecs and r1:
        best = min(codecs, key=lambda r: r["seconds"])
        out.append((f"best codec ({best['system']} {best['config']}) / DDP PowerSGD rank 1",
                    best["seconds"] / r1["seconds"], BEST_CODEC_LIMIT.get(topo_name)))
    for rank in (1, 4):
        theirs = find(rows, "torch", f"DDP PowerSGD rank {rank}")
        for system in ("bps_gc collective", "bps_gc PS"):
            ours = find(rows, system, f"powersgd rank {rank}")
            ratio = ours["seconds"] / theirs["seconds"] if ours and theirs else None
            out.append((f"our powersgd rank {rank} ({system}) / torch's", ratio, 1.0))
    return [(what, ratio, limit, "n/a" if ratio is None else "" if limit is None
             else "ok" if ratio <= limit else "MISS") for what, ratio, limit in out]


def print_table(title, rows, topo_name, shaped):
    gloo = find(rows, "torch", "torch all_reduce dense")
    r1 = find(rows, "torch", "DDP PowerSGD rank 1")
    head = ["system", "config", "topology", "s/round", "min", "max", "push MB/w", "pull MB/w"]
    if shaped:
        head.append("NIC MB/m0")
    head += ["CPU%", "vs gloo", "vs PSGD r1"]
    lines, failed = [], []
    for r in rows:
        if r.get("error"):
            lines.append([r["system"], r["config"], r["topology"], "FAILED"])
            failed.append(f"  {r['system']} {r['config']} ({r['topology']}) FAILED: {r['error']}")
            continue
        cells = [r["system"], r["config"], r["topology"], f"{r['seconds']:.3f}", f"{r['min']:.3f}",
                 f"{r['max']:.3f}", fmt_mb(r.get("pushed_wire")), fmt_mb(r.get("pulled_wire"))]
        if shaped:
            link = r.get("link_tx_per_worker")
            cells.append("-" if link is None else fmt_mb(link + r["link_rx_per_worker"]))
        busy = r.get("machine_busy")
        cells += ["-" if busy is None else f"{100 * busy:.0f}",
                  f"{r['seconds'] / gloo['seconds']:.2f}" if gloo else "-",
                  f"{r['seconds'] / r1['seconds']:.2f}" if r1 else "-"]
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *[c + [""] * (len(head) - len(c)) for c in lines])]
    out = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
    out += failed
    out.append("\ntargets (issue 10 and 12):")
    for what, ratio, limit, ok in targets(rows, topo_name):
        shown = "n/a" if ratio is None else f"{ratio:.2f}"
        bound = f"<= {limit:g}" if limit is not None else "(no target at this link)"
        out.append(f"  {what}: {shown} {bound if ratio is not None else ''} {ok}".rstrip())
    text = "\n".join(out)
    print(text, flush=True)
    return text
