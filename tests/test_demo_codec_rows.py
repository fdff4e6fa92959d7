"""The demo's issue-11 rows (example/demo/codec_rows.py, mnist_demo.py --codec-rows) at --quick
size: the DGC row compresses every tensor but its biases, warms its sparsity up by epoch (the
worker's set_epoch), and its pull is the union of the workers' sparse pushes."""
import json
import os
import subprocess
import sys

import pytest

from conftest import LAUNCH_PYTHONPATH, ROOT, skip_unless_installed

DEMO = os.path.join(ROOT, "example", "demo", "mnist_demo.py")
skip_unless_installed("torch", "mlxtend", "matplotlib", "tqdm")  # the demo's processes import them


def test_dgc_row(tmp_path):
    result = subprocess.run([sys.executable, DEMO, "--quick", "--configs", "dgc", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    [row] = json.loads((tmp_path / "results.json").read_text())["configs"]
    assert row["min_compress_bytes"] == 0 and "DGC 0.1%, warm-up 5 epochs" in result.stdout
    # --quick is 2 epochs: 25% then 6.3% of each weight kept (uint32 index + float16 value each
    # way, the pull at most both workers' pairs), the biases dense: about 2.8x less than float32
    assert 2.2 < row["ratio"] < 4, row["ratio"]
    assert row["final_accuracy"] > 0.3
