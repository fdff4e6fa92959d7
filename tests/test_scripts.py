"""The measurement scripts under scripts/ run end to end at a tiny size and write what they promise.
(The numbers themselves are benchmarks, never asserted as timings.)"""
import json
import os
import subprocess
import sys

import pytest

from conftest import LAUNCH_PYTHONPATH, ROOT

SCRIPTS = os.path.join(ROOT, "scripts")


def run_script(name, *args, timeout=240):
    env = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH)
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, name), *args], capture_output=True,
                            text=True, timeout=timeout, cwd=ROOT, env=env)
    assert result.returncode == 0, f"{name} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_slow_network_two_configs(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("mlxtend")
    result = run_script("slow_network.py", "--rate", "1gbit", "--configs", "baseline,topk", "--epochs",
                        "0.05", "--hidden", "64", "--out", str(tmp_path))
    if "skipped" in result.stdout:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    rows = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {"baseline", "topk"}
    assert all(r["epoch_seconds"] > 0 for r in rows.values())
    # topk 1% + EF sends a few percent of the dense bytes
    assert rows["topk"]["wire_mb_per_epoch"] < rows["baseline"]["wire_mb_per_epoch"] / 5
    assert "baseline" in result.stdout and "speed-up" in result.stdout


def test_choco_bytes_counts_the_gossip_message(tmp_path):
    out = tmp_path / "choco.json"
    run_script("choco_bytes.py", "--json", str(out), timeout=120)
    data = json.loads(out.read_text())
    rows = {r["q"]: r["bytes"] for r in data["rows"]}
    tensors, params = data["tensors"], data["dense_bytes"] // 4
    assert (tensors, params) == (65, 272_474)  # CIFAR ResNet-20 v1, 10 classes
    head = 4 + 4 * tensors  # uint32 count + one uint32 length per tensor
    assert rows["none (D-PSGD)"] == head + 4 * params
    # top-1%: at least one (uint32 index, float32 value) pair per tensor, 1% of each otherwise
    assert head + 8 * tensors < rows["top-1%"] == rows["random-1%"] < head + 8 * (params // 100 + 2 * tensors)
    # signnorm: one bit per element (whole 32-bit words) plus one float scale per tensor
    assert rows["signnorm"] > head + params // 8


def test_thc_decode_floor_prints_every_case_beside_onebit():
    """scripts/bench_thc_decode_floor.py (docs/codecs.md, thc's decode against the memory traffic it
    cannot avoid), tiny: both decoders and the four floor loops, each with its ratio to onebit's."""
    with open("/proc/cpuinfo") as f:
        if "avx512f" not in f.read():
            pytest.skip("the floor loops need AVX-512, which this CPU lacks")
    result = run_script("bench_thc_decode_floor.py", "--sizes", "64K", "--rounds", "1", "--repeats", "1")
    lines = [line for line in result.stdout.splitlines() if line.startswith("  ")]
    assert [line.split("  ")[1].strip() for line in lines][:3] == [
        "EF + onebit decode", "thc 4-bit decode (float64 words)", "thc 4-bit decode (int64 words)"]
    assert len(lines) == 7 and all(line.rstrip().endswith("x") for line in lines), lines
    assert lines[0].rstrip().endswith("1.00x")  # onebit against itself


def test_a_scripts_child_keeps_the_callers_pythonpath(tmp_path):
    """The scripts' launched ranks get the checkout first, then the caller's PYTHONPATH as it was
    (a plugin module named by BPS_GC_PLUGINS, or the tests' sitecustomize, loads in them)."""
    code = "import bench_common; print(bench_common.pythonpath('/a', '/b'))"
    for caller, want in [(f"{tmp_path}{os.pathsep}/c", os.pathsep.join(["/a", "/b", str(tmp_path), "/c"])),
                         (None, os.pathsep.join(["/a", "/b"]))]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if caller is not None:
            env["PYTHONPATH"] = caller
        got = subprocess.run([sys.executable, "-c", code], cwd=SCRIPTS, env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert got == want
