"""scripts/scale_on_paper.py's output: the printed table, docs/scale.md's markdown tables and
the plot, from its rows (dicts of per-round counts, bytes)."""
import os


def nic_ms(row, gbit):
    """Milliseconds the busiest host's NIC needs for the round at line rate (full duplex)."""
    return max(row["out"], row["in"]) * 8 / (gbit * 1e9) * 1e3


def cell(row):
    mark = {"bound": "<=", "held": "~"}.get(next((k for k in ("bound", "held") if k in row["reply"]), ""), "")
    return f"{mark}{row['out'] / 1e6:.1f}/{row['in'] / 1e6:.1f} MB, {row['msgs']:,} msg"


def server_cell(row):
    if "server_in" not in row:
        return ""
    return (f"; srv {row['server_in'] / 1e6:,.0f}/{row['server_out'] / 1e6:,.0f} MB, "
            f"{row['server_fan_in']:,} in")


def summary(rows, hosts, picks, gbit=25):
    """docs/scale.md's first table: per design and codec, the busiest NIC's MB per round
    (max of in and out, worker host or PS server) and its milliseconds at ``gbit``."""
    lines = [f"| design | codec | " + " | ".join(f"H={h}" for h in hosts) + " |",
             "|---|---|" + "---|" * len(hosts)]
    for design in dict.fromkeys(r["design"] for r in rows):
        for codec, reducer in picks:
            per = {r["hosts"]: r for r in rows if r["design"] == design and r["codec"] == codec
                   and r["reducer"] in (reducer, "Q")}
            if not per:
                continue
            cells = []
            for h in hosts:
                r = per[h]
                busiest = max(r["out"], r["in"], r.get("server_in", 0), r.get("server_out", 0))
                cells.append(f"{busiest / 1e6:,.0f} ({busiest * 8 / (gbit * 1e9) * 1e3:,.0f})")
            shown = "" if reducer == "sum" else " (Q)" if design.startswith("gossip") else f" ({reducer})"
            lines.append(f"| {design} | {codec}{shown} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(rows, hosts):
    """One line per design x codec x reducer; per host count: out/in MB and messages at the
    busiest host (PS: then the busiest server's MB in and its pushes per round)."""
    by_key = {}
    for row in rows:
        by_key.setdefault((row["design"], row["codec"], row["reducer"]), {})[row["hosts"]] = row
    print(f"{'design':<20} {'codec':<16} {'reducer':<10} " + " | ".join(f"H={h}" for h in hosts))
    for (design, codec, reducer), per in by_key.items():
        cells = []
        for h in hosts:
            row = per.get(h)
            if row is None:
                cells.append("-")
                continue
            cells.append(cell(row) + server_cell(row))
        print(f"{design:<20} {codec:<16} {reducer:<10} " + " | ".join(cells))


def markdown(rows, hosts, designs):
    """docs/scale.md's tables: per design, rows codec x reducer, columns host counts."""
    lines = []
    for design in designs:
        sub = [r for r in rows if r["design"] == design]
        if not sub:
            continue
        lines += [f"**{design}** (busiest host, per round: NIC MB out/in, messages in + out"
                  + ("; busiest server: NIC MB in/out, pushes in" if design.startswith("ps") else "") + ")", "",
                  "| codec | reducer | " + " | ".join(f"H={h} (N={h * sub[0]['local']})" for h in hosts) + " |",
                  "|---|---|" + "---|" * len(hosts)]
        keys = list(dict.fromkeys((r["codec"], r["reducer"]) for r in sub))
        for codec, reducer in keys:
            per = {r["hosts"]: r for r in sub if (r["codec"], r["reducer"]) == (codec, reducer)}
            cells = []
            for h in hosts:
                r = per.get(h)
                cells.append("-" if r is None else cell(r) + server_cell(r))
            lines.append(f"| {codec} | {reducer} | " + " | ".join(cells) + " |")
        gaps = {r["hosts"]: r.get("spectral_gap") for r in sub}
        if any(g is not None for g in gaps.values()):
            lines.append("| (spectral gap of the graph) | | " + " | ".join(
                "-" if gaps.get(h) is None else f"{gaps[h]:.2e}" for h in hosts) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rows, path, codec_rows=(("dense", "sum"),)):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    codec_rows = [(c, red) for c, red in codec_rows if any(r["codec"] == c for r in rows)]
    fig, axes = plt.subplots(1, len(codec_rows), figsize=(6.5 * len(codec_rows), 4.8), squeeze=False)
    for ax, (codec, reducer) in zip(axes[0], codec_rows):
        for design in dict.fromkeys(r["design"] for r in rows):
            pts = sorted((r["hosts"], max(r["out"], r["in"]) / 1e6) for r in rows
                         if r["design"] == design and r["codec"] == codec
                         and (r["reducer"] == reducer or design.startswith("gossip")))
            if pts:
                line, = ax.plot(*zip(*pts), marker="o", label=design)
            srv = sorted((r["hosts"], max(r["server_in"], r["server_out"]) / 1e6) for r in rows
                         if r["design"] == design and r["codec"] == codec and r["reducer"] == reducer
                         and "server_in" in r)
            if srv:
                ax.plot(*zip(*srv), ls="--", marker=".", color=line.get_color(), label=f"{design}: server")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"hosts (x{rows[0]['local']} ranks)")
        ax.set_ylabel("MB per round through the busiest NIC (max of in, out)")
        ax.set_title(f"ResNet-50, {codec}" + (f" ({reducer})" if reducer != "sum" else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
