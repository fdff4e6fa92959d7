"""tests/gc_paused_imports.py, which keeps the suite within its time: a process launched with the
tests' PYTHONPATH imports torch with the collector paused and its objects frozen, keeps torch's
own loader, and no test launches its scripts without tests/ on the path (their processes would
import torch at twice the CPU, uncounted by scripts/suite_census.py)."""
import glob
import os
import re
import subprocess
import sys

from conftest import LAUNCH_PYTHONPATH, ROOT

PROBE = ("import gc, torch, importlib.machinery as m; "
         "print(gc.isenabled(), gc.get_freeze_count(), type(torch.__loader__) is m.SourceFileLoader, "
         "torch.__spec__.loader is torch.__loader__)")


def test_a_launched_process_imports_torch_paused_and_frozen():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH)).stdout.split()
    enabled, frozen, own_loader, same = out
    assert enabled == "True" and own_loader == "True" and same == "True", out
    assert int(frozen) > 100_000, out  # torch's objects, out of the collector's way


def test_no_test_launches_without_the_tests_folder_on_its_path():
    bare = re.compile(r"""PYTHONPATH["']?\s*[=:]\s*ROOT\b(?!\s*\+)|PYTHONPATH=os\.path\.dirname\(TESTS\)""")
    found = [f"{os.path.basename(path)}:{n}" for path in sorted(glob.glob(os.path.join(ROOT, "tests", "*.py")))
             for n, line in enumerate(open(path), 1) if bare.search(line)]
    assert not found, f"launch with conftest.LAUNCH_PYTHONPATH, not ROOT alone: {found}"
