"""Runs a training script (``python interrupted_run.py SCRIPT ARGS...``) whose process ends at
once, as if killed, right after it wrote its COUNT-th checkpoint whose file name contains
MARKER (INTERRUPT_AFTER="MARKER:COUNT"): no shutdown, nothing after it (tests/test_resume_scripts.py).

With COPY_TO=FOLDER the process does not end there: it copies that checkpoint, as written, to
FOLDER at its path relative to the working directory (or to COPY_ROOT), and trains on. So one
straight run also leaves the checkpoint a resumed run starts from, in another folder: what an
interrupted launch would have left, without launching it (every launch costs seconds of CPU).
There COUNT may be several, "MARKER:1,4": each of those saves is copied (a process that runs
several checkpointed runs, tests/lm_fsdp_job.py)."""
import os
import runpy
import shutil
import sys

import bps_gc.torch as bps

marker, counts = os.environ["INTERRUPT_AFTER"].rsplit(":", 1)
copy_to, root = os.environ.get("COPY_TO"), os.environ.get("COPY_ROOT", os.getcwd())
wanted = {int(count) for count in counts.split(",")}
saves = [0]  # the saves whose file name holds MARKER, so far
write = bps.save_checkpoint


def save_then_end(obj, path):
    write(obj, path)
    if marker in os.path.basename(str(path)):
        saves[0] += 1
        if saves[0] in wanted and copy_to:
            target = os.path.join(copy_to, os.path.relpath(os.path.abspath(str(path)), root))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(str(path), target)
        elif saves[0] in wanted:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


bps.save_checkpoint = save_then_end
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
