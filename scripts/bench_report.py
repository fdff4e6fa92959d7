"""bench_pushpull: summarizing the workers' results and printing the table."""
import json
import os
import statistics


from bench_cluster import ClusterFailed
from bench_common import import_netns

# A full TCP segment on the benchmark's veths (MTU 1500, timestamps on): 1448 bytes of payload
# in 1514 bytes that tbf charges (Ethernet, IP and TCP headers).
SEGMENT_PAYLOAD, SEGMENT_BYTES = 1448, 1514


def summarize(system, config, passes, local_ranks=1):
    """One row from the workers' JSON results of every pass: worker 0's round times (all passes
    pooled), byte counts (rank 0's, and its host's: ranks 0 .. local_ranks-1), CPU and link
    counters."""
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
        def host_mean(key):  # machine 0's ranks together: with two levels each pushes a share
            return sum(statistics.fmean(r.get(key, 0) or 0 for results in passes for r in results[rank]["rounds"])
                       for rank in range(local_ranks))
        row.update(host_pushed_wire=host_mean("pushed_wire"), host_pulled_wire=host_mean("pulled_wire"))
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
    the payload a parameter-server row must move through it (its busier direction): G, the
    bytes the machine's ranks push together (one copy of the gradient with two levels, one per
    local rank flat; one rank per machine: its own), goes out (M-1)/M to the other machines'
    servers, and the co-located server sends its 1/M of every other machine's G back:
    2 x (M-1)/M x G each way for M machines (a ring all_reduce moves the same); a machine
    whose servers are all elsewhere sends G. No schedule of those bytes can take less. None
    on loopback or for rows that are not the parameter server's."""
    placement, machines = row.get("placement"), row.get("machines") or row.get("workers")
    grad = row.get("host_pushed_wire") or row.get("pushed_wire")
    if topo_name == "loopback" or placement is None or not machines or not grad:
        return None
    nic = 2 * (machines - 1) / machines * grad if placement == "colocated" else grad
    return nic * SEGMENT_BYTES / SEGMENT_PAYLOAD * 8 / import_netns().parse_rate(topo_name)


def nic_floor(row, topo_name):
    """Seconds machine 0's NIC needs per round at the shaped rate for the bytes the row moved
    through it (its busier direction, frames as the veth counts them): the floor of rows
    without a byte model (torch's, the collective's). None where nothing was counted."""
    tx, rx = row.get("link_tx_per_worker"), row.get("link_rx_per_worker")
    if topo_name == "loopback" or tx is None or rx is None:
        return None
    return max(tx, rx) * 8 / import_netns().parse_rate(topo_name)


def row_floor(row, topo_name):
    """(seconds, how): the byte model's floor for parameter-server rows, else the NIC's."""
    floor = link_floor(row, topo_name)
    if floor is not None:
        return floor, "model"
    floor = nic_floor(row, topo_name)
    return (floor, "nic") if floor is not None else (None, None)


def fmt_mb(value):
    return "-" if value is None else f"{value / 1e6:.2f}"


def find(rows, system, config):
    return next((r for r in rows if r["system"] == system and r["config"] == config
                 and not r.get("error")), None)


BEST_CODEC_LIMIT = {"loopback": 1.0, "1gbit": 0.8}  # issue 12: best codec / DDP PowerSGD rank 1


DENSE = ("dense", "dense in place", "dense views", "dense (local reduce)", "dense (host's TCP congestion control)", "dense (flat)")  # not codecs
# issue 25, 2 machines of several ranks: two-level dense rows / gloo's flat all_reduce of every rank
LOCAL_RANKS_LIMIT = {("bps_gc PS", "dense"): 0.65, ("bps_gc collective", "dense"): 0.8}
VIEWS_LIMIT = 1.1  # issue 43: collective dense of views of flat buffers / gloo all_reduce, one rank a machine
THC_LIMIT = 1.0  # issue 35: thc 4-bit rounds / onebit+EF's on the same transport, same run
SAME_ROW_LIMIT = 1.5  # issue 25: a compressed row at L ranks per machine / the same row at 1

def targets(rows, topo_name):
    """The issue's targets as [(what, ratio or None, limit or None, verdict)]."""
    out = []
    gloo = find(rows, "torch", "torch all_reduce dense")
    for r in rows:
        if r["system"] in ("bps_gc PS", "bps_gc collective") and r["config"] in DENSE and not r.get("error"):
            several = (r.get("local_ranks") or 1) > 1
            views = r["system"] == "bps_gc collective" and r["config"] == "dense views" and not several
            if r["system"] == "bps_gc collective" and not several and not views:
                continue  # one rank per machine: only the collective's views row has a target
            ratio = r["seconds"] / gloo["seconds"] if gloo else None
            floor, how = row_floor(r, topo_name)
            what = "line rate for its NIC's bytes" if how == "model" else "line rate for the bytes machine 0's NIC moved"
            bound = f" [{what}: {floor:.3f} s = {floor / gloo['seconds']:.2f}x gloo]" if floor and gloo else ""
            # issue 25's limits are set at 2 machines; at more the floor alone is closer to gloo's
            limit = (LOCAL_RANKS_LIMIT.get((r["system"], r["config"])) if r.get("machines") == 2 else None) \
                if several else VIEWS_LIMIT if views else 1.0
            name = "PS" if r["system"] == "bps_gc PS" else "collective"
            out.append((f"{name} {r['config']} ({r['topology']}) / gloo all_reduce{bound}", ratio, limit))
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
    for system in ("bps_gc PS", "bps_gc collective"):  # issue 35: summed 4-bit codes no slower
        ours, theirs = find(rows, system, "thc 4-bit"), find(rows, system, "onebit+EF")
        if ours or theirs:
            ratio = ours["seconds"] / theirs["seconds"] if ours and theirs else None
            out.append((f"thc 4-bit / onebit+EF ({system})", ratio, THC_LIMIT))
    return [(what, ratio, limit, "n/a" if ratio is None else "" if limit is None
             else "ok" if ratio <= limit else "MISS") for what, ratio, limit in out]


def same_rows(rows, baseline):
    """[(what, ratio, limit, verdict)]: each row of this run against the same row (system,
    config) of ``baseline``'s (an earlier run's JSON rows, e.g. at one rank per machine);
    bps_gc's compressed rows must stay within SAME_ROW_LIMIT, the others are shown."""
    out = []
    for r in rows:
        theirs = find(baseline, r["system"], r["config"])
        if r.get("error") or theirs is None:
            continue
        # issue 25's limit is bps_gc's (two levels); torch's hooks run flat over every rank: shown
        compressed = r["system"].startswith("bps_gc") and r["config"] not in DENSE
        ratio = r["seconds"] / theirs["seconds"]
        limit = SAME_ROW_LIMIT if compressed else None
        out.append((f"{r['system']} {r['config']}: {r['topology']} / {theirs['topology']}", ratio, limit,
                    "" if limit is None else "ok" if ratio <= limit else "MISS"))
    return out


def host_floor_lines(rows, baseline):
    """What the host-level floor row (bench_host_floor.py) means for the compressed rows: the
    baseline's row (one rank per machine) plus the floor is the time two levels take on these
    cores if they add only their memory work (a little less where the cores do it while the
    baseline's round waits on the network); its ratio to the baseline shows whether
    SAME_ROW_LIMIT is within reach."""
    floor = next((r for r in rows if r.get("host_floor")), None)
    if floor is None:
        return []
    out = [f"\nhost-level floor ({floor['topology']}): {floor['seconds']:.3f} s/round, the memory work of "
           f"two levels alone (bench_host_floor.py: copy in, sum, copy out of {floor['bytes'] / 1e6:.1f} MB "
           f"per rank in shared memory)"]
    for r in rows:
        compressed = r["system"].startswith("bps_gc") and r["config"] not in DENSE and not r.get("error")
        theirs = find(baseline or [], r["system"], r["config"]) if compressed else None
        if theirs is not None:
            least = theirs["seconds"] + floor["seconds"]
            out.append(f"  {r['system']} {r['config']}: baseline {theirs['seconds']:.3f} s + floor = "
                       f"{least:.3f} s = {least / theirs['seconds']:.2f}x the baseline (measured "
                       f"{r['seconds']:.3f} s = {r['seconds'] / least:.2f}x that)")
    return out


def print_table(title, rows, topo_name, shaped, baseline=None):
    gloo = find(rows, "torch", "torch all_reduce dense")
    r1 = find(rows, "torch", "DDP PowerSGD rank 1")
    head = ["system", "config", "topology", "s/round", "min", "max", "push MB/w", "pull MB/w"]
    if shaped:
        head += ["NIC MB/m0", "floor s"]
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
            floor, how = row_floor(r, topo_name)
            r["floor_seconds"], r["floor_from"] = floor, how
            cells.append("-" if floor is None else f"{floor:.3f}" + ("" if how == "model" else "*"))
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
    if shaped:
        out.append("floor s: the line rate's time for the bytes the parameter server's design moves "
                   "through a machine's NIC (bench_report.link_floor); *: for the bytes machine 0's "
                   "NIC moved (busier direction)")
    out.append("\ntargets (issues 10, 12, 25, 35 and 43):")
    for what, ratio, limit, ok in targets(rows, topo_name):
        shown = "n/a" if ratio is None else f"{ratio:.2f}"
        bound = f"<= {limit:g}" if limit is not None else "(no target here)"
        out.append(f"  {what}: {shown} {bound if ratio is not None else ''} {ok}".rstrip())
    if baseline is not None:
        out.append("\nagainst the same rows of the baseline run (issue 25: compressed rows within "
                   f"{SAME_ROW_LIMIT:g}x):")
        for what, ratio, limit, ok in same_rows(rows, baseline):
            out.append(f"  {what}: {ratio:.2f} {'' if limit is None else f'<= {limit:g}'} {ok}".rstrip())
    out += host_floor_lines(rows, baseline)
    text = "\n".join(out)
    print(text, flush=True)
    return text
