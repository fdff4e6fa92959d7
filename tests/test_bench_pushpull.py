"""scripts/bench_pushpull.py runs end to end on loopback (quick rows, the first few ResNet-50
tensors) and writes its table, ratios to the targets and JSON, and BENCH_TRACE files into a
folder that did not exist. Timings are never asserted."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def test_bench_pushpull_quick(tmp_path):
    out = tmp_path / "bench.json"
    trace = tmp_path / "no-such-folder" / "t"
    result = subprocess.run([sys.executable, "scripts/bench_pushpull.py", "--quick", "--tensors", "6",
                             "--pslite", "none", "--configs", "dense,dense (local reduce)", "--collective-rows",
                             "all_reduce,PowerSGD rank 1,collective topk 0.1%", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, BENCH_TRACE=str(trace)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["system"], r["config"]): r for r in data["results"]}
    assert {("torch", "torch all_reduce dense"), ("torch", "torch floor, views: all_reduce dense (AVG)"),
            ("torch", "DDP PowerSGD rank 1"),
            ("bps_gc collective", "topk 0.1%"), ("bps_gc PS", "dense"), ("bps_gc PS", "dense (local reduce)")} == set(rows)
    assert rows[("bps_gc PS", "dense")]["check"] == "ok"  # the dense sum is exact
    assert rows[("bps_gc PS", "dense")]["topology"] == "2 workers, servers colocated"
    local = rows[("bps_gc PS", "dense (local reduce)")]
    assert local["check"] == "ok" and local["pushed_wire"] == 0, local  # summed by the workers, exact
    assert local["topology"] == "2 workers summing in shared memory, servers colocated (idle)"
    assert data["meta"]["env"].get("BPS_GC_LOCAL_REDUCE") is None  # set for that row's cluster only
    for config in ("dense", "dense (local reduce)"):
        for rank in (0, 1):
            assert json.loads((tmp_path / "no-such-folder" / f"t.{config}.w{rank}.json").read_text())["marks"]
    assert all(r["seconds"] > 0 for r in rows.values())
    assert rows[("bps_gc collective", "topk 0.1%")]["py_cpu_s"] > 0  # bench_collective's, through bench_run
    what = [t[0] for t in data["targets"]]
    assert "PS dense (2 workers, servers colocated) / gloo all_reduce" in what
    assert any(w.startswith("best codec") for w in what)
    assert "PS dense (2 workers, servers colocated) / gloo all_reduce" in result.stdout


def test_plot_nic_trace_rates(tmp_path):
    """scripts/plot_nic_trace.py: a machine sending 125,000 bytes and receiving 62,500 every
    10 ms uses 100 and 50 Mbit/s of its NIC in each round, and the plot is written."""
    for rank in range(2):
        samples = [(1000.0 + i * 0.01, i * 125_000, i * 62_500) for i in range(301)]
        marks = [(1000.0, "start"), (1001.0, "end"), (1001.5, "start"), (1003.0, "end")]
        (tmp_path / f"t.dense.w{rank}.json").write_text(json.dumps({"samples": samples, "marks": marks}))
    png = tmp_path / "nic.png"
    result = subprocess.run([sys.executable, "scripts/plot_nic_trace.py", str(tmp_path / "t.dense"), "--out", str(png)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("1.00 s (tx 100, rx 50 Mbit/s); 1.50 s (tx 100, rx 50 Mbit/s)") == 2
    assert png.stat().st_size > 1000


def test_bench_pushpull_shaped_with_a_namespace_default(tmp_path):
    """--shaped with --tcp-congestion: every machine's default is the named algorithm (what
    gloo gets), bps_gc's own links use cubic unless the row asks for the machines' default, and
    both dense rows are exact. Skipped where namespaces cannot be made (not root)."""
    import pytest
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        if "reno" not in f.read().split():
            pytest.skip("the kernel has no reno")
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "scripts/bench_pushpull.py", "--quick", "--tensors", "6",
                             "--shaped", "1gbit", "--tcp-congestion", "reno", "--pslite", "none",
                             "--configs", "dense,dense (host's TCP congestion control)",
                             "--collective-rows", "all_reduce", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    if "skipped: cannot set up network namespaces" in result.stdout:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    data = json.loads(out.read_text())
    from bps_gc.config import available_congestion_controls, congestion_refusal
    ours = "cubic" if "cubic" in available_congestion_controls() and congestion_refusal("cubic") is None else None
    assert data["meta"]["tcp_congestion_default"] == "reno"
    assert data["meta"]["bps_gc_tcp_congestion"] == ours
    rows = {(r["system"], r["config"]): r for r in data["results"]}
    for config in ("dense", "dense (host's TCP congestion control)"):
        assert rows[("bps_gc PS", config)]["check"] == "ok", rows
        assert rows[("bps_gc PS", config)]["topology"] == "2 workers, servers colocated"
    assert f"TCP congestion control by default: reno; bps_gc's links: {ours or 'the default'}" in result.stdout
    floors = [t[0] for t in data["targets"] if t[0].startswith("PS dense (2 workers, servers colocated)")]
    assert len(floors) == 1 and "line rate for its NIC's bytes" in floors[0], data["targets"]


def test_link_floor_is_the_line_rate_time_of_full_segments():
    """ResNet-50 dense (102.2 MB per worker), 4 ranks: a co-located server's machine sends
    2 x 3/4 x 102.2 MB, 153.3 MB, in 1448-byte segments of 1514 bytes: 1.2823 s at 1 Gbit/s;
    with the servers elsewhere a worker sends 102.2 MB: 0.8549 s."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_report import link_floor
    row = {"placement": "colocated", "workers": 4, "pushed_wire": 102.2e6}
    assert abs(link_floor(row, "1gbit") - 1.2823) < 1e-4
    assert abs(link_floor(row, "100mbit") - 12.823) < 1e-3
    assert abs(link_floor(dict(row, placement="separate"), "1gbit") - 0.8549) < 1e-4
    assert link_floor(row, "loopback") is None and link_floor({}, "1gbit") is None
