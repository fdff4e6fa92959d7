"""A training script run several times in one launch (torchrun or bpslaunch --servers 0:
tests/test_cifar10_choco.py, test_study_scripts.py, test_dgc_train.py, test_resume_scripts.py),
so that its processes start once: ``runs_job.py RUNS.json``, RUNS a list of {"script": path (default
example/pytorch/train_cifar10_choco.py), "cwd": folder, "argv": [flags], "env": {name: value}
(optional), "copy_to": folder (optional)}. Each run is the script as its command line runs it
(``__main__``; its sys.exit(0) ends the run, not the job), in its folder (it reads and writes
there), with "env" set while it runs (the environment is restored whole after it, so what a
script sets, as DGC's train.py sets the seed's BYTEPS_MIN_COMPRESS_BYTES with setdefault, stays
with its run), and with its own bps_gc init() and shutdown() on the
default process group this job makes once (init() adopts it and leaves it to the job).
"copy_to": the run goes through tests/interrupted_run.py with INTERRUPT_AFTER=rank:1 and that
COPY_TO: its first checkpoints are copied there as written. bps_gc.torch names a job's
optimizers and hooks of a kind in the order it makes them (DistributedOptimizer.0, .1, ...), from
0 again after each shutdown(), as a fresh process does: a run's checkpoints load in another
process, and another process's in a run, wherever the run sits in its launch."""
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
    env = dict(run.get("env", {}))
    if "copy_to" in run:
        env.update(INTERRUPT_AFTER="rank:1", COPY_TO=run["copy_to"])
    before = dict(os.environ)  # restored whole after the run: what the script set stays its own
    os.environ.update(env)
    sys.argv = [*([INTERRUPT] if "copy_to" in run else []), run.get("script", SCRIPT), *run["argv"]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:  # sys.exit(main()) of a run that went well: the next run
        if e.code not in (None, 0):
            raise
    finally:
        bps.save_checkpoint = save_checkpoint
        os.environ.clear()
        os.environ.update(before)
dist.destroy_process_group()
