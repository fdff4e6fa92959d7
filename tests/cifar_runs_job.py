"""example/pytorch/train_cifar10_choco.py run several times in one launch (torchrun or bpslaunch
--servers 0: tests/test_cifar10_choco.py), so that its processes start once:
``cifar_runs_job.py RUNS.json``, RUNS a list of {"cwd": folder, "argv": [flags], "copy_to": folder
(optional)}. Each run is the script as its command line runs it (``__main__``), in its folder (it
reads and writes there), with its own bps_gc init() and shutdown() on the default process group
this job makes once (init() adopts it and leaves it to the job). "copy_to": the run goes through
tests/interrupted_run.py with INTERRUPT_AFTER=rank:1 and that COPY_TO: its first checkpoints are
copied there as written."""
import json
import os
import runpy
import sys

import torch.distributed as dist

import bps_gc.torch as bps
from gloo_group import init_default_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "example", "pytorch", "train_cifar10_choco.py")
INTERRUPT = os.path.join(ROOT, "tests", "interrupted_run.py")

runs = json.load(open(sys.argv[1]))
init_default_group()
save_checkpoint = bps.save_checkpoint  # interrupted_run.py wraps it: each run unwraps it after
for run in runs:
    os.chdir(run["cwd"])
    copying = "copy_to" in run
    if copying:
        os.environ.update(INTERRUPT_AFTER="rank:1", COPY_TO=run["copy_to"])
    sys.argv = [*([INTERRUPT] if copying else []), SCRIPT, *run["argv"]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        bps.save_checkpoint = save_checkpoint
        for name in ("INTERRUPT_AFTER", "COPY_TO"):
            os.environ.pop(name, None)
dist.destroy_process_group()
