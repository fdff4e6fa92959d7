"""Runs a training script (``python interrupted_run.py SCRIPT ARGS...``) whose process ends at
once, as if killed, right after it wrote its COUNT-th checkpoint whose file name contains
MARKER (INTERRUPT_AFTER="MARKER:COUNT"): no shutdown, nothing after it (tests/test_resume_scripts.py)."""
import os
import runpy
import sys

import bps_gc.torch as bps

marker, count = os.environ["INTERRUPT_AFTER"].rsplit(":", 1)
saves = [int(count)]
write = bps.save_checkpoint


def save_then_end(obj, path):
    write(obj, path)
    if marker in os.path.basename(str(path)):
        saves[0] -= 1
        if saves[0] == 0:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


bps.save_checkpoint = save_then_end
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
