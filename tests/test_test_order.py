"""The suite's file order without a pytest cache (a fresh clone, CI): heaviest first by the
committed tests/file_seconds.json, files it does not know before them (tests/conftest.py)."""
import json
import os
import subprocess
import sys

from conftest import ROOT

FILES = ["tests/test_layers.py", "tests/test_restart_state.py", "tests/test_barrier.py", "tests/test_job_thread.py"]


def test_without_a_cache_the_files_come_heaviest_first_by_the_committed_record(tmp_path):
    with open(os.path.join(ROOT, "tests", "file_seconds.json")) as f:
        recorded = json.load(f)
    known = [path for path in FILES if path in recorded]
    assert len(known) >= 3, "the committed record lacks the suite's files: scripts/record_test_order.py"
    unknown = tmp_path / "test_not_recorded.py"  # a file the record has never seen
    unknown.write_text("def test_nothing():\n    pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "--rootdir", ROOT, *FILES, str(unknown)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    order = []
    for line in result.stdout.splitlines():  # node ids, in the order they would run
        path = "(not recorded)" if line.endswith("::test_nothing") else line.split("::", 1)[0]
        if "::" in line and path not in order:
            order.append(path)
    assert order[0] == "(not recorded)", order
    assert order[1:] == sorted(known, key=lambda path: -recorded[path]), (order, {p: recorded[p] for p in known})
