"""The one-command demo (example/demo/mnist_demo.py) at --quick size: real local clusters train
on real MNIST digits; the table, the JSON and the PNG come out and make sense; a second run with
the same seed and thread count gives the same results.json, times aside."""
import json
import os
import struct
import subprocess
import sys

import pytest

from conftest import LAUNCH_PYTHONPATH, ROOT, load_script, skip_unless_installed

DEMO = os.path.join(ROOT, "example", "demo", "mnist_demo.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

skip_unless_installed("torch", "mlxtend", "matplotlib", "tqdm")  # the demo's processes import them


# what may differ between two runs: times, and the log paths (each run has its own folder)
NOT_REPEATED = {"total_seconds", "wall_seconds", "train_seconds", "log"}


def run_quick(out, *args):
    env = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH)
    result = subprocess.run([sys.executable, DEMO, "--quick", "--out", str(out), *args], capture_output=True,
                            text=True, timeout=240, cwd=ROOT, env=env)
    assert result.returncode == 0, f"demo failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def repeatable(results):
    """results.json less what is allowed to differ between runs."""
    drop = lambda row: {k: v for k, v in row.items() if k not in NOT_REPEATED}  # noqa: E731
    return dict(drop(results), configs=[drop(row) for row in results["configs"]])


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, run_quick(out)


def test_quick_table_json_png(quick_run):
    out, result = quick_run
    data = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in data["configs"]}
    assert {"baseline", "onebit"} <= set(rows)

    # the table: a line per configuration it ran, and nothing of the workers' output
    lines = result.stdout.splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("configuration")]
    assert header, result.stdout
    for name in rows:
        assert any(line.startswith(name + " ") for line in lines[header[0]:]), (name, result.stdout)
    assert "[worker" not in result.stdout and "PROGRESS" not in result.stdout

    for name, r in rows.items():
        assert r["steps"] == data["steps"] > 0
        assert r["final_accuracy"] > 0.2, (name, r["curve"])  # chance is 0.1
        assert r["curve"][0][0] == 0 and r["curve"][-1][0] == r["steps"]
        assert r["wire_bytes_per_step"] > 0 and r["raw_bytes_per_step"] > 0
        assert r["wall_seconds"] > 0
        # every step moves the whole model raw: 784x128 + 128 + 128x10 + 10 float32, both ways
        assert r["raw_bytes_per_step"] == 2 * 4 * (784 * 128 + 128 + 128 * 10 + 10)
        if r["compression_params"]:
            assert r["ratio"] > 1.5, (name, r["ratio"])
            assert r["wire_bytes_per_step"] < rows["baseline"]["wire_bytes_per_step"] / 1.5
        else:
            assert r["ratio"] == pytest.approx(1.0)
        assert os.path.exists(r["log"])

    png = (out / "accuracy.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 800 and height >= 400
    assert len(png) > 20_000


def test_same_seed_and_threads_repeat_bit_for_bit(quick_run, tmp_path):
    first_out, first = quick_run
    assert "seed 0, 1 thread(s) per worker" in first.stdout  # the defaults, printed
    assert "machine: " in first.stdout
    second = run_quick(tmp_path, "--seed", "0", "--threads", "1")
    a, b = (json.loads((out / "results.json").read_text()) for out in (first_out, tmp_path))
    assert (a["seed"], a["threads"]) == (b["seed"], b["threads"]) == (0, 1)
    # exactly: json keeps every float's bits (repr round-trips), so == is bit for bit
    assert repeatable(a) == repeatable(b), second.stdout


def test_another_seed_gives_another_run(quick_run, tmp_path):
    first_out, _ = quick_run
    run_quick(tmp_path, "--configs", "onebit", "--seed", "1")
    a, b = (json.loads((out / "results.json").read_text()) for out in (first_out, tmp_path))
    onebit = next(row for row in a["configs"] if row["config"] == "onebit")
    assert b["seed"] == 1 and b["configs"][0]["curve"] != onebit["curve"]


def test_unknown_configuration_is_refused(capsys):
    """In this process (argparse refuses before anything starts: no process to test): the
    demo's parse_args, which main() calls first, exits 2 naming the problem. parse_args rather
    than main(): a flag wrongly accepted fails here at once instead of running the demo."""
    demo = load_script(DEMO)
    with pytest.raises(SystemExit) as stopped:
        demo.parse_args(["--configs", "baseline,nope"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert "nope" in err and "onebit" in err
    for flag, value in (("--threads", "0"), ("--seed", "-1")):
        with pytest.raises(SystemExit) as stopped:
            demo.parse_args([flag, value])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and flag in err, err


def test_demo_sh_says_what_it_installs_before_installing(tmp_path):
    """A fresh clone's first ./scripts/demo.sh spends minutes installing: its first line says
    what and how big. Here the interpreter that would make the venv is `false`, so the install
    stops at once, after that line."""
    env = dict(os.environ, BPS_GC_VENV=str(tmp_path / "venv"), PYTHON="false")
    result = subprocess.run([os.path.join(ROOT, "scripts", "demo.sh")], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode != 0 and not (tmp_path / "venv").exists()
    first = result.stderr.splitlines()[0]
    assert first == (f"demo.sh: first run: installing torch 2.13.0 (CPU wheel), MXNet 1.9.1, numpy, pyzmq and "
                     f"the test tools into {tmp_path / 'venv'} (about 1.8 GB; a minute or more), then the demo "
                     "starts"), result.stderr
