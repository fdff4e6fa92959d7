"""scripts/bench_server_cpu.py at smoke size: every configuration gets a row with its ratio to
onebit+EF, and thc's keys are the dense phase keys the server adds (no reducer runs)."""
import json
import os
import subprocess
import sys

from conftest import LAUNCH_PYTHONPATH, ROOT


def test_rows_and_ratios(tmp_path):
    out = tmp_path / "cpu.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_server_cpu.py"), "--workers", "3",
                             "--rounds", "1", "--tensors", "12", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode == 0, result.stderr[-3000:]
    seconds = json.loads(out.read_text())["seconds"]
    assert set(seconds) == {"onebit+EF", "thc 4-bit", "thc 4-bit+EF"} and seconds["onebit+EF"] > 0
    assert "x onebit+EF" in result.stdout


def test_thc_keys_are_dense_phase_sums():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_server_cpu import keys_for
    from bench_common import load_shapes
    keys = keys_for("thc 4-bit", load_shapes(12), 3)
    assert keys and all(not state.compressed for state, _ in keys)
    # the server's sum of the code phase equals numpy's sum of the pushes, element for element
    state, pushes = keys[-1]
    for r, push in enumerate(pushes):
        state.buffers[r], state.lengths[r], state.via_shm[r] = push, push.size, False
    import numpy as np
    total = state.compute(0, [0, 1, 2])
    assert np.array_equal(total, np.sum([p.view(np.float64) for p in pushes], axis=0))
