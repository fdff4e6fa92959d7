"""tests/cluster_job.py for several rank counts in one launch (``bpslaunch --servers 0``), so
that its processes start once: ``cluster_jobs.py JOBS.json``, JOBS a list of {"spec": SPEC.json,
"out": folder, "workers": n}, largest first, run one after the other, each on ranks 0..n-1 of
the launch in a gloo group of its own (gloo_group.init_job_group) that bps_gc's init() adopts
and leaves to this script; the ranks outside a job skip it (and, the jobs largest first, the
ones after it). Largest first: a rank counts its adoptions (collective/rendezvous.py keys each
adoption's heartbeats by its number), so every rank of a job must have run the same jobs before."""
import json
import os
import runpy
import sys

import torch.distributed as dist

from gloo_group import init_job_group

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_job.py")

jobs = json.load(open(sys.argv[1]))
assert [job["workers"] for job in jobs] == sorted((job["workers"] for job in jobs), reverse=True), jobs
all_reduce = dist.all_reduce  # cluster_job.py wraps it for views: each run its own wrapper
for number, job in enumerate(jobs):
    if not init_job_group(number, job["workers"]):
        break
    sys.argv = [JOB, job["spec"], job["out"]]
    runpy.run_path(JOB, run_name="__main__")
    dist.all_reduce = all_reduce
    dist.destroy_process_group()
