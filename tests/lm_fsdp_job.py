"""example/pytorch/lm/train.py run several times in one launch (torchrun or bpslaunch --servers 0:
tests/test_lm.py), so
that its processes start once: ``lm_fsdp_job.py FLAGS... + FLAGS... + ...``, one run per group
of flags, each announced by rank 0 as ``=== run <i>``. Every run does its own bps.init() and
bps.shutdown(), as train.py's main does, on the default process group this script makes once
(bps.init() adopts it and leaves it to the script). A group ``--lm-ddp-job OUT STEPS`` runs
tests/lm_ddp_job.py's DDP training (its own seed, model and optimizer) instead of train.py."""
import importlib.util
import os
import sys

import torch.distributed as dist

import lm_ddp_job
from gloo_group import init_default_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("lm_train", os.path.join(ROOT, "example", "pytorch", "lm", "train.py"))
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)
runs = [[]]
for word in sys.argv[1:]:
    if word == "+":
        runs.append([])
    else:
        runs[-1].append(word)
init_default_group()
for i, flags in enumerate(runs):
    if dist.get_rank() == 0:
        print(f"=== run {i}", flush=True)
    if flags[:1] == ["--lm-ddp-job"]:
        lm_ddp_job.train(flags[1], int(flags[2]))
    else:
        train.main(flags)
dist.destroy_process_group()
