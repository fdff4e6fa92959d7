"""torch's default process group for a test job that makes its own (as a DDP script does, not
through bps_gc's init()), from whichever launcher started it: torchrun (RANK, WORLD_SIZE,
MASTER_ADDR/PORT: env://) or ``bpslaunch --local --servers 0`` (DMLC_WORKER_ID is the rank,
DMLC_NUM_WORKER the size, and rank 0 hosts the store at DMLC_PS_ROOT_URI:PORT, where bps_gc's
own rendezvous would). The same gloo group either way; bpslaunch spares the launch torchrun's
agent process (it imports torch: ~1.7 s of CPU)."""
import os

import torch.distributed as dist


def init_default_group(backend="gloo"):
    env = os.environ
    if "RANK" in env or "DMLC_NUM_WORKER" not in env:
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt != "0" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torch elastic's agent keeps its store over restarts: env:// would read the killed
            # attempt's gloo addresses (connection refused), so each restart has keys of its own
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False)
            dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", store),
                                    rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))
            return
        dist.init_process_group(backend)
        return
    if env.get("BYTEPS_LOCAL_SIZE", "1") != "1":
        raise SystemExit("gloo_group: under bpslaunch, one rank per worker (--local-size 1) only")
    dist.init_process_group(backend, init_method=f"tcp://{env['DMLC_PS_ROOT_URI']}:{env['DMLC_PS_ROOT_PORT']}",
                            rank=int(env["DMLC_WORKER_ID"]), world_size=int(env["DMLC_NUM_WORKER"]))


_launch_store = None  # init_job_group's: one store a launch, kept while its jobs run


def init_job_group(job, size, backend="gloo"):
    """Under ``bpslaunch --servers 0``, several jobs one after the other in one launch (its
    processes start once): the default group of job number ``job`` on the launch's ranks
    0..``size``-1, its keys apart (a prefix) in one store that rank 0 hosts at
    DMLC_PS_ROOT_URI:PORT, as init_default_group's. Every rank of the launch calls it for every
    job (the store waits for all of them); False where the rank is outside the job. DMLC_NUM_WORKER
    becomes ``size``: bps_gc's init() checks the group it adopts against it."""
    global _launch_store
    env = os.environ
    rank = int(env["DMLC_WORKER_ID"])
    if _launch_store is None:
        _launch_store = dist.TCPStore(env["DMLC_PS_ROOT_URI"], int(env["DMLC_PS_ROOT_PORT"]),
                                      int(env["DMLC_NUM_WORKER"]), rank == 0)
    if rank >= size:
        return False
    env["DMLC_NUM_WORKER"] = str(size)
    dist.init_process_group(backend, store=dist.PrefixStore(f"job{job}", _launch_store), rank=rank, world_size=size)
    return True
