"""scripts/diloco_overlap.py (issue 44's overlap target, docs/diloco_overlap.md) runs end to end
on loopback, tiny (H = 8, one block, batch 2): every row is timed on both ranks, the DiLoCo rows
sync, the table and the JSON are written, and a progress bar follows the blocks. Timings are
never asserted. A setting it cannot run is refused in one line."""
import json
import subprocess
import sys

from conftest import ROOT

SCRIPT = "scripts/diloco_overlap.py"


def test_diloco_overlap_runs_tiny(tmp_path):
    out = tmp_path / "overlap.json"
    result = subprocess.run([sys.executable, SCRIPT, "--sync-every", "8", "--blocks", "1", "--batch-size", "2",
                             "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert len(rows) == 6 and all(r["mean_ms"] > 0 for r in rows.values()), rows
    assert all(len(ranks[0]) == len(ranks[1]) == 8 for ranks in report["step_seconds"].values())  # a block of H
    synced = [r for name, r in rows.items() if name.startswith("DiLoCo")]
    assert len(synced) == 4 and all(r["syncs"] >= 1 for r in synced), synced
    assert all(row in result.stdout for row in rows) and f"JSON: {out}" in result.stdout
    assert "blocks: 100%" in result.stderr and "| 1/1 [" in result.stderr


def test_a_window_too_short_for_four_fragments_is_one_line():
    result = subprocess.run([sys.executable, SCRIPT, "--sync-every", "4"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "--sync-every must be >= 8 (F=4, tau=1)" in result.stderr
    assert "Traceback" not in result.stderr
