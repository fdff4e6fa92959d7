"""scripts/bench_hook.py runs end to end on loopback (--quick: a small model, a few rows) and
writes its table and JSON, with a held fraction for the rows that time the bps_gc hook and the
DistributedOptimizer (on torch.distributed and on the parameter server), and with --timeline
every stage's stamps of every bucket of one traced step, in the order the stages run, and a
progress bar over the rounds. Timings are never asserted."""
import json
import subprocess
import sys

from conftest import ROOT


def test_bench_hook_quick(tmp_path):
    out = tmp_path / "bench_hook.json"
    result = subprocess.run([sys.executable, "scripts/bench_hook.py", "--quick", "--rows",
                             "no communication,bps_gc hook,alone,DistributedOptimizer", "--timeline", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"DDP no communication", "bps_gc hook topk 1% + EF", "topk 1% + EF reduction alone",
                         "bps_gc DistributedOptimizer topk 1% + EF",
                         "bps_gc DistributedOptimizer topk 1% + EF (parameter server)"}
    assert all(r["median_s"] > 0 and len(r["times"]) == 3 for r in rows.values())
    for name in ("bps_gc hook topk 1% + EF", "bps_gc DistributedOptimizer topk 1% + EF",
                 "bps_gc DistributedOptimizer topk 1% + EF (parameter server)"):
        assert 0 < rows[name]["held"] <= 1, rows[name]
    assert rows["DDP no communication"]["held"] is None
    assert "rounds (ps): 100%" in result.stderr and "| 6/6 [" in result.stderr  # 3 rounds a transport, a bar
    assert "target: held fraction, bps_gc hook topk 1% + EF" in result.stdout
    assert "target: step / max(no communication, reduction alone)" in result.stdout
    for name in ("bps_gc hook topk 1% + EF", "topk 1% + EF reduction alone"):
        trace = rows[name]["timeline"]
        stages = ["called", "compress start", "compress end", "exchange start",
                  "all_gather of payloads start", "all_gather of payloads end", "exchange end", "reduce start",
                  "reduced", "completed"]
        buckets = {}
        for index, event, wall, _ in trace["stamps"]:
            buckets.setdefault(index, {})[event] = wall
        assert buckets, trace
        for index, stamps in buckets.items():  # one gather per bucket: its payloads' size is known by now
            assert "all_gather of payload sizes start" not in stamps, stamps
            assert [stamps[e] for e in stages] == sorted(stamps[e] for e in stages), (name, index, stamps)
            assert stamps["called"] <= stamps["returned"] <= stamps["completed"]  # (compressing may start first)
        assert trace["thread_cpu_s"]["bps_gc-comm-hook-compress"] > 0
        assert f"timeline, {name}, rank 0" in result.stdout
