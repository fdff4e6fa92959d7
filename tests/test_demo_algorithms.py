"""The demo's issue-13 rows (example/demo/algorithms.py, mnist_demo.py --algorithms) at --quick
size: local SGD's bytes per step are the dense baseline's times the share of steps that average;
CHOCO and D-PSGD rows once worker-to-worker messages exist."""
import json
import os
import subprocess
import sys

import pytest

from conftest import LAUNCH_PYTHONPATH, ROOT, skip_unless_installed

DEMO = os.path.join(ROOT, "example", "demo", "mnist_demo.py")
# the baseline's bytes a worker moves each step, worked out rather than run as a row (a cluster
# fewer): the MLP's float32 parameters pushed and pulled (test_demo.py checks the baseline row's
# raw bytes are these and its wire bytes the same to 1e-6)
DENSE_BYTES_PER_STEP = 2 * 4 * (784 * 128 + 128 + 128 * 10 + 10)
skip_unless_installed("torch", "mlxtend", "matplotlib", "tqdm")  # the demo's processes import them


def run_demo(configs, out):
    result = subprocess.run([sys.executable, DEMO, "--quick", "--configs", configs, "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {r["config"]: r for r in json.loads((out / "results.json").read_text())["configs"]}, result.stdout


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One demo run of every row the tests read (each row its own cluster, as in runs of its own)."""
    return run_demo("localsgd-h4,choco-signnorm,dpsgd", tmp_path_factory.mktemp("demo"))


def test_local_sgd_row(demo):
    rows, table = demo
    steps = rows["localsgd-h4"]["steps"]
    averaging = len(range(0, steps, 4))  # the first step, then every 4th
    assert rows["localsgd-h4"]["wire_bytes_per_step"] == pytest.approx(
        DENSE_BYTES_PER_STEP * averaging / steps, rel=1e-6)
    assert "local SGD, H=4" in table and rows["localsgd-h4"]["final_accuracy"] > 0.3


def test_decentralized_rows(demo):
    rows = {name: row for name, row in demo[0].items() if name in ("choco-signnorm", "dpsgd")}
    # D-PSGD sends the float32 model to 2 neighbours a step; CHOCO signnorm about 1/32 of that
    assert rows["dpsgd"]["ratio"] == pytest.approx(1.0, rel=0.01)
    assert rows["choco-signnorm"]["wire_bytes_per_step"] < rows["dpsgd"]["wire_bytes_per_step"] / 20
    assert all(r["final_accuracy"] > 0.3 for r in rows.values())
