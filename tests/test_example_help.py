"""Every runnable example and script answers --help (argparse formats every help string: a
stray '%' in one is a crash a user meets first)."""
import glob
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "example", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "scripts", "*.py"))
                 if "__main__" in open(p).read() and "argparse" in open(p).read())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_help(script):
    result = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout and "Traceback" not in result.stderr
