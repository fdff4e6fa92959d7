"""The benchmarks with several ranks per machine (issue 25), end to end at tiny sizes in network
namespaces: scripts/bench_pushpull.py --local-ranks 2 on 2 machines (its rows, the exact dense
sums, one copy of the tensor per machine with two levels against one per rank flat, the floors,
the host-level floor row, the targets and a --baseline's ratios), and scripts/recipe_shape.py at a reduced shape (3 hosts
x 4 ranks, 6 servers: exact against numpy), whose checker must also catch a wrong value.
Timings are never asserted. Skipped where namespaces cannot be made (not root)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import LAUNCH_PYTHONPATH, ROOT

ELEMENTS = 3000  # one 60 x 50 float32 matrix: 12,000 bytes


def run(argv, timeout):
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if "cannot set up network namespaces" in result.stdout + result.stderr:
        pytest.skip((result.stdout + result.stderr).strip().splitlines()[-1])
    return result


def test_bench_pushpull_two_machines_of_two_ranks(tmp_path):
    out, baseline = tmp_path / "bench.json", tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"results": [
        {"system": "bps_gc collective", "config": "onebit+EF", "topology": "2 workers", "seconds": 1000.0}]}))
    result = run(["scripts/bench_pushpull.py", "--local-ranks", "2", "--shaped", "10gbit", "--elements", str(ELEMENTS),
                  "--quick", "--pslite", "none", "--configs", "dense,dense (flat)",
                  "--collective-rows", "all_reduce,collective dense,collective onebit",
                  "--baseline", str(baseline), "--json", str(out)], 240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["local_ranks"] == 2 and data["meta"]["elements"] == ELEMENTS
    assert data["meta"]["bytes"] == 4 * ELEMENTS and "cores" in data["meta"]["machine"]
    rows = {(r["system"], r["config"]): r for r in data["results"]}
    # the host level's memory work alone (bench_host_floor.py), measured, beside the rows
    host_floor = rows.pop(("host level", "floor: copy in, sum, copy out"))
    assert host_floor["topology"] == "2 machines x 2 ranks, numpy, no network" and len(host_floor["rounds"]) == 2
    assert 0 < host_floor["seconds"] == data["meta"]["host_level_floor"]["seconds"]
    # "collective dense" picks the collective's dense rows (out=, in place, views), "all_reduce"
    # torch's and the views' floor (its AVG)
    assert set(rows) == {("torch", "torch all_reduce dense"), ("bps_gc collective", "dense"),
                         ("bps_gc collective", "dense in place"), ("bps_gc collective", "onebit+EF"),
                         ("bps_gc collective", "dense views"), ("torch", "torch floor, views: all_reduce dense (AVG)"),
                         ("bps_gc PS", "dense"), ("bps_gc PS", "dense (flat)")}
    two, flat = rows[("bps_gc PS", "dense")], rows[("bps_gc PS", "dense (flat)")]
    assert two["check"] == "ok" and flat["check"] == "ok"  # every rank's average of all 4 ranks
    assert two["topology"] == "2 machines x 2 ranks, servers colocated, two levels"
    assert flat["topology"] == "2 machines x 2 ranks, servers colocated, flat"
    # two levels: machine 0's ranks push one copy of the tensor together; flat: one copy each
    assert two["host_pushed_wire"] == 4 * ELEMENTS and flat["host_pushed_wire"] == 2 * 4 * ELEMENTS
    # the floor: machine 0 moves 2 x (2-1)/2 x its pushes each way, in 1448-byte payloads of 1514
    assert two["floor_seconds"] == pytest.approx(4 * ELEMENTS * 1514 / 1448 * 8 / 10e9)
    assert flat["floor_seconds"] == pytest.approx(2 * two["floor_seconds"])
    assert all(r["floor_seconds"] is not None and r["seconds"] > 0 for r in rows.values())
    targets = {t[0].split(" [")[0]: t for t in data["targets"]}
    assert targets["PS dense (2 machines x 2 ranks, servers colocated, two levels) / gloo all_reduce"][2] == 0.65
    assert targets["collective dense (2 machines x 2 ranks) / gloo all_reduce"][2] == 0.8
    (what, ratio, limit, verdict), = data["against_baseline"]["rows"]
    assert what == "bps_gc collective onebit+EF: 2 machines x 2 ranks / 2 workers" and limit == 1.5
    assert ratio == pytest.approx(rows[("bps_gc collective", "onebit+EF")]["seconds"] / 1000.0) and verdict == "ok"
    assert "floor s" in result.stdout and "2 machines x 2 ranks" in result.stdout
    least = 1000.0 + host_floor["seconds"]
    assert (f"bps_gc collective onebit+EF: baseline 1000.000 s + floor = {least:.3f} s = "
            f"{least / 1000.0:.2f}x the baseline") in result.stdout


def test_recipe_shape_reduced(tmp_path):
    out = tmp_path / "recipe.json"
    result = run(["scripts/recipe_shape.py", "--hosts", "3", "--local-ranks", "4", "--servers", "6", "--steps", "2",
                  "--join-timeout", "120", "--timeout", "150", "--json", str(out)], 200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ranks_checked"] == 12 and data["problems"] == []
    assert data["recipe_env"]["worker"]["BYTEPS_PARTITION_BYTES"] == "4096000"
    assert "BYTEPS_LOCAL_SIZE" not in json.dumps(data["recipe_env"])  # the recipe never sets it
    assert "exact, each host pushing one copy of every tensor, against numpy" in result.stdout


def test_recipe_shape_checker_catches_one_wrong_value(tmp_path):
    """recipe_shape.check against results written here: exact ones pass; one value off by one
    ulp in one rank's file, a missing rank, and a host whose ranks pushed a copy each (flat,
    not two levels) are named."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import recipe_shape
    from types import SimpleNamespace
    args = SimpleNamespace(hosts=2, local_ranks=2, steps=2)
    one_copy = 4 * sum(recipe_shape.TENSORS) * 2
    for r in range(4):
        got = {f"{t}/{s}": recipe_shape.expected(t, s, n, 4) for t, n in enumerate(recipe_shape.TENSORS) for s in range(2)}
        shares = [one_copy // 3, one_copy - one_copy // 3]  # the host's owners split the pushes
        np.savez(tmp_path / f"rank{r}.npz", size=np.int64(4), pushed=np.int64(shares[r % 2]), **got)
    assert recipe_shape.check(str(tmp_path), args) == []
    # numpy's oracle is the plain mean of the small-integer inputs
    manual = np.mean([recipe_shape.rank_input(r, 2, 1, recipe_shape.TENSORS[2]) for r in range(4)], axis=0)
    assert recipe_shape.expected(2, 1, recipe_shape.TENSORS[2], 4).tobytes() == manual.astype(np.float32).tobytes()
    got = dict(np.load(tmp_path / "rank3.npz"))
    got["4/1"] = got["4/1"].copy()
    got["4/1"][7] = np.nextafter(got["4/1"][7], np.float32(np.inf))
    got["pushed"] = np.int64(one_copy)  # with rank 2's share: more than one copy
    np.savez(tmp_path / "rank3.npz", **got)
    os.remove(tmp_path / "rank0.npz")
    problems = recipe_shape.check(str(tmp_path), args)
    assert problems[0] == "rank 0 wrote no results" and len(problems) == 3, problems
    assert problems[1] == f"host 1 pushed {one_copy + one_copy // 3} bytes, not one copy of every tensor per step ({one_copy})"
    assert problems[2].startswith("rank 3 tensor 4 (64 elements) step 1: max difference"), problems


def test_host_floor_on_three_hosts():
    """Three hosts of two ranks: every host's barrier its own (the third host's once took the
    first's freed state and hung). The floor is a time, positive, per timed round."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_host_floor.py"), "--machines", "3",
                             "--local-ranks", "2", "--tensor-mb", "0.012", "--rounds", "2"],
                            capture_output=True, text=True, timeout=100, cwd=ROOT, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "host-level floor, 3 machines x 2 ranks" in result.stdout and " s/round" in result.stdout
