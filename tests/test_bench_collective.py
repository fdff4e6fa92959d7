"""scripts/bench_collective.py runs end to end (a few rows, quick rounds) and writes its JSON."""
import json
import subprocess
import sys

from conftest import ROOT


def test_bench_collective_quick(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "scripts/bench_collective.py", "--quick", "--rows",
                             "all_reduce,PowerSGD,collective topk", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"torch all_reduce dense", "DDP PowerSGD rank 1", "bps_gc collective topk 0.1%"}
    assert rows["DDP PowerSGD rank 1"]["vs_powersgd_rank1"] == 1.0
    assert all(r["median_s"] > 0 for r in rows.values())
    assert "vs PowerSGD r1" in result.stdout
