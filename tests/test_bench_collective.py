"""scripts/bench_collective.py runs end to end (a few rows, quick rounds, ResNet-50's first 20 gradients)
and writes its JSON; so does scripts/time_to_accuracy.py (one MNIST epoch), whose --machines is
refused where it cannot run."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def test_bench_collective_quick(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "scripts/bench_collective.py", "--quick", "--rows",
                             "all_reduce,PowerSGD,collective topk", "--tensors", "20", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"torch all_reduce dense", "DDP PowerSGD rank 1", "bps_gc collective topk 0.1%"}
    assert rows["DDP PowerSGD rank 1"]["vs_powersgd_rank1"] == 1.0
    assert all(r["median_s"] > 0 for r in rows.values())
    # the Python threads' CPU (the bookkeeping beside the collectives): some, each round
    assert all(len(r["py_cpus"]) == r["rounds"] and r["py_cpu_s"] > 0 for r in rows.values())
    assert "vs PowerSGD r1" in result.stdout and "py CPU ms" in result.stdout


def test_time_to_accuracy_one_epoch(tmp_path):
    result = subprocess.run([sys.executable, "scripts/time_to_accuracy.py", "--epochs", "1", "--out", str(tmp_path),
                             "--rows", "PowerSGD rank 1,collective onebit,PS onebit"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert set(data["rows"]) == {"DDP dense", "DDP PowerSGD rank 1", "bps_gc collective onebit + EF + nesterov",
                                 "bps_gc PS onebit + EF + nesterov", "the limit (no exchange)"}
    dense, limit = data["rows"]["DDP dense"], data["rows"]["the limit (no exchange)"]
    assert dense["seconds_to_target"] is not None and limit["steps_to_target"] == dense["steps_to_target"] > 0
    assert limit["seconds_to_target"] == limit["steps_to_target"] * data["compute_seconds_per_step"] > 0
    assert all(r["final_accuracy"] > 0.5 for n, r in data["rows"].items() if n != "the limit (no exchange)")
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 10_000
    trained = len(data["rows"]) - 1  # every row but the limit (computed): the progress bar saw each end
    assert re.search(rf"100%\|[^|]*\| {trained}/{trained} ", result.stderr), result.stderr[-1000:]


@pytest.mark.parametrize("argv, message", [
    (["--task", "lm", "--machines", "1"], "--machines must be >= 2"),
    (["--machines", "4"], "other than 2 for --task lm's data-parallel and DiLoCo rows only, got 4"),
    (["--task", "lm", "--hsdp", "--local-ranks", "2", "--machines", "3"], "--machines must be >= 2, and other than 2"),
])
def test_time_to_accuracy_refuses_machines_it_cannot_run(argv, message, capsys):
    """--machines: 2 or more, and other than 2 for the LM's data-parallel and DiLoCo rows only
    (the MNIST rows and the HSDP table run 2 machines): refused in one line at the parse."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import time_to_accuracy
    with pytest.raises(SystemExit) as exit_:
        time_to_accuracy.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert time_to_accuracy.parse_args(["--task", "lm", "--machines", "4"]).machines == 4
