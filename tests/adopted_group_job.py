"""Two runs of bps_gc on one process group the script made (as tests/lm_fsdp_job.py runs train.py
again and again), or the group tests/runs_job.py made when it runs this script (after other runs
on it): bps.init() adopts the group, bps.shutdown() leaves it. The second run issues
more collectives than the first, and rank 1 is late to its third one by more than a heartbeat
interval, so rank 0 waits there while its heartbeat reads the store: the first run's endings
must not read as ranks that left this run. Prints each run's sums, and the names of its state: a
CompressedExchange made in each run is named as in a fresh process, and run 1's, still alive in
run 2, is no part of run 2's state."""
import time

import torch
import torch.distributed as dist

import bps_gc.torch as bps

made_here = not dist.is_initialized()  # under runs_job.py the job made it, and ends it
if made_here:
    dist.init_process_group("gloo")
rank = dist.get_rank()
exchange = None
for run, collectives in ((1, 2), (2, 4)):
    bps.init()
    # run 1's exchange, still alive in run 2: its state is the first run's, no part of this one's
    # one write per line, newline included (PYTHONUNBUFFERED: print writes its end apart, and the
    # ranks share torchrun's stdout)
    print(f"rank {rank} run {run} objects before its exchange {sorted(bps.state_dict()['objects'])}\n", end="",
          flush=True)
    exchange = bps.CompressedExchange({"compressor": "topk", "k": 0.5, "ef": "vanilla"})
    exchange({"g": torch.arange(4.0) * (rank + 1)}).wait()
    print(f"rank {rank} run {run} state {sorted(bps.state_dict()['objects'])}\n", end="", flush=True)
    sums = []
    for i in range(collectives):
        if run == 2 and rank == 1 and i == 2:
            time.sleep(1.0)  # five heartbeat intervals (BPS_GC_HEARTBEAT_INTERVAL=0.2)
        tensor = torch.full((4,), float(rank + 1 + i))
        bps.push_pull_inplace(tensor, average=False, name=f"run{run}.t{i}")
        sums.append(tensor[0].item())
    bps.shutdown()
    print(f"rank {rank} run {run} sums {sums}", flush=True)
if made_here:
    dist.destroy_process_group()
