"""bps_gc.torch.CompressedExchange on two sub-groups of 2 ranks (spec "groups") under
bps_gc.torch.init(), one rank leaving early: ``python exchange_leave_job.py SPEC.json OUT``.
Every rank writes OUT/pid<rank> first. Rank spec "victim" ends its script (``sys.exit(0)``)
before its step 3, writing OUT/fault_time; its group-mate goes on exchanging (and must fail,
naming it). The other group's ranks, once it left (OUT/fault_time, then 2 s: many heartbeats),
exchange 3 more times and write OUT/done<rank> with the last average's sum."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.torch as bps  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
bps.init()
rank = dist.get_rank()
open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
groups = [dist.new_group(ranks) for ranks in spec["groups"]]
mine = next(g for g, ranks in zip(groups, spec["groups"]) if rank in ranks)
victims_group = next(ranks for ranks in spec["groups"] if spec["victim"] in ranks)
exchange = bps.CompressedExchange(spec["compression_params"])
fault_time = os.path.join(out, "fault_time")
step, after = 0, None
while after is None or after < 3:
    if step == 3 and rank == spec["victim"]:
        open(fault_time, "w").write(repr(time.time()))
        sys.exit(0)
    if after is None and rank not in victims_group and step >= 3:
        while not os.path.exists(fault_time):
            time.sleep(0.05)
        time.sleep(2.0)
        after = 0
    generator = torch.Generator().manual_seed(1000 * rank + step)
    tensors = {"w": torch.randn(64, generator=generator), "b": torch.randn(8, generator=generator)}
    exchange(tensors, group=mine).wait()
    step += 1
    after = None if after is None else after + 1
open(os.path.join(out, f"done{rank}"), "w").write(repr(float(sum(t.sum() for t in tensors.values()))))
bps.shutdown()
