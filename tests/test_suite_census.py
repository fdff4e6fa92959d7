"""scripts/suite_census.py's two halves: a launched process records its CPU at exit when
BPS_GC_CENSUS is set (tests/sitecustomize.py), and the sums by kind and by test."""
import json
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import suite_census  # noqa: E402


def test_a_launched_process_records_itself_only_when_asked(tmp_path):
    path = tmp_path / "census.jsonl"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests"), PYTEST_CURRENT_TEST="tests/x.py::t (call)")
    code = "import json; sum(range(3_000_000))"  # some CPU, no torch
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert not path.exists()
    subprocess.run([sys.executable, "-c", code], env=dict(env, BPS_GC_CENSUS=str(path)), check=True)
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["test"] == "tests/x.py::t" and line["script"] == "-c"
    assert line["torch"] is False and line["dynamo"] is False and 0 < line["cpu"] < 30


def test_sums_by_kind_and_by_test():
    lines = [{"script": "a.py", "test": "t1", "cpu": 2.5, "torch": True, "dynamo": True},
             {"script": "a.py", "test": "t1", "cpu": 1.5, "torch": True, "dynamo": True},
             {"script": "b.py", "test": "t2", "cpu": 1.0, "torch": True, "dynamo": False},
             {"script": "node.py", "test": "t2", "cpu": 0.25, "torch": False, "dynamo": False}]
    report = suite_census.summarise(lines)
    assert report["processes"] == 4 and report["cpu_s"] == 5.2
    assert [(r["processes"], r["cpu_s"], r["median_cpu_s"]) for r in report["by_kind"]] == [(2, 4.0, 2.0), (1, 1.0, 1.0),
                                                                                             (1, 0.2, 0.25)]
    assert report["by_test"] == [{"test": "t1", "processes": 2, "cpu_s": 4.0}, {"test": "t2", "processes": 2, "cpu_s": 1.2}]
    # by program and kind, costliest first: which programs import torch
    assert [(r["script"], r["processes"], r["cpu_s"]) for r in report["by_script"]] == [("a.py", 2, 4.0), ("b.py", 1, 1.0),
                                                                                         ("node.py", 1, 0.2)]
