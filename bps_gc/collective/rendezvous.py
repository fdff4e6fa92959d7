"""Where the ranks meet: the environment (torchrun's or bpslaunch's) -> Config, TCPStore and
process group.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; bpslaunch
sets DMLC_WORKER_ID (the rank), DMLC_NUM_WORKER, DMLC_PS_ROOT_URI/PORT (the rendezvous, hosted by
rank 0) and BYTEPS_LOCAL_RANK/SIZE. Both become one Config, so every BYTEPS_*/BPS_GC_* setting
(partition bytes, heartbeat) means the same on either transport.
"""
import datetime
import os

import torch
import torch.distributed as dist

from ..comm import NodeFailure
from ..config import Config, ConfigError, EnvReader
from ..wire.waiting import WaitLines
from .backend_choice import backend_for_devices
from .security import refuse_security_settings, store_listener

TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("gloo", "nccl", "mpi")


def collective_config(environ=None):
    """(Config, local_rank, local_size) from torchrun's variables or bpslaunch's DMLC_* ones."""
    env = dict(os.environ if environ is None else environ)
    if "DMLC_NUM_WORKER" not in env and all(name in env for name in TORCHRUN):
        local_size = env.get("LOCAL_WORLD_SIZE", "1")
        # the rank is the worker id of a one-rank "machine": Config.rank = worker_id
        env.update(DMLC_NUM_WORKER=env["WORLD_SIZE"], DMLC_WORKER_ID=env["RANK"],
                   DMLC_PS_ROOT_URI=env["MASTER_ADDR"], DMLC_PS_ROOT_PORT=env["MASTER_PORT"],
                   BYTEPS_LOCAL_SIZE="1", BYTEPS_LOCAL_RANK="0")
        local = (int(env.get("LOCAL_RANK", "0")), int(local_size))
    else:
        local = None
    env["DMLC_NUM_SERVER"] = "0"
    refuse_security_settings(env)
    cfg = Config.from_env(env, role="worker")
    return cfg, *(local or (cfg.local_rank, cfg.local_size))


def host_key(cfg, environ=None):
    """Which host this rank runs on, as its launcher numbers them: bpslaunch's DMLC_WORKER_ID
    (Config.worker_id; it counts hosts), torchrun's GROUP_RANK (the agent's node rank), else the
    rank over LOCAL_WORLD_SIZE (levels.py checks that the ranks agree)."""
    env = os.environ if environ is None else environ
    if "DMLC_NUM_WORKER" in env or not all(name in env for name in TORCHRUN):
        return cfg.worker_id
    if "GROUP_RANK" in env:
        return int(env["GROUP_RANK"])
    return int(env["RANK"]) // max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))


def backend_from_env(environ=None, local_size=1):
    """(backend, why): BPS_GC_BACKEND, else gloo for host arrays plus NCCL for CUDA tensors when
    each of the host's ``local_size`` ranks has a GPU of its own (backend_choice.py)."""
    env = os.environ if environ is None else environ
    chosen = EnvReader(env).choice("BPS_GC_BACKEND", BACKENDS, "")
    if chosen:
        if chosen == "mpi" and not dist.is_mpi_available():
            raise ConfigError("BPS_GC_BACKEND", "mpi: this torch was built without MPI")
        return chosen, "BPS_GC_BACKEND"
    cuda = torch.cuda.is_available()
    return backend_for_devices(cuda, dist.is_nccl_available(), torch.cuda.device_count() if cuda else 0, local_size)


def connect(cfg, backend):
    """Join the process group; returns the key-value store the ranks share (for heartbeats)
    and whether this rank hosts it.

    Under torchrun the agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); else rank 0 does.
    The group's own timeout only bounds a peer that is alive but silent; a dead one is found
    by the heartbeat (liveness.py) long before.
    """
    timeout = datetime.timedelta(seconds=cfg.join_timeout)
    if backend == "mpi":
        dist.init_process_group("mpi", timeout=timeout)
        return None, False
    host_store = hosts_store(cfg)
    try:
        listener = store_listener(cfg.root_uri, cfg.root_port) if host_store else None
        store = dist.TCPStore(cfg.root_uri, cfg.root_port, cfg.size, is_master=host_store,
                              timeout=timeout, wait_for_workers=False, master_listen_fd=listener)
    except (RuntimeError, OSError) as e:
        raise ConnectionError(f"bps_gc: cannot reach the rendezvous at {cfg.root_uri}:{cfg.root_port} "
                              f"as rank {cfg.rank}: {e}") from None
    prefix = key_prefix()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(f"{prefix}/group", store), rank=cfg.rank,
                                world_size=cfg.size, timeout=timeout)
    except dist.DistStoreError as e:  # a rank that never came: the store waited out the timeout
        raise NodeFailure(f"bps_gc: the job did not assemble within {cfg.join_timeout:g} s "
                          f"(BPS_GC_JOIN_TIMEOUT; rank {cfg.rank} of {cfg.size} waited): {e}") from None
    return dist.PrefixStore(f"{prefix}/live", store), host_store


def hosts_store(cfg):
    """Whether this rank hosts the rendezvous store: rank 0, unless torchrun's agent does."""
    return cfg.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def key_prefix():
    """torch elastic keeps its agent's store over restarts: each attempt's keys apart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return "bps_gc" if attempt == "0" else f"bps_gc/attempt{attempt}"


def adopt(cfg):
    """The default process group the script made before bps_gc's init (FSDP2 scripts build their
    mesh on it first): the heartbeat's store within its store, and whether this rank hosts it
    (rank 0, unless torchrun's agent does). Its rank and size must be the job's."""
    if (dist.get_rank(), dist.get_world_size()) != (cfg.rank, cfg.size):
        raise ConfigError("RANK", f"the process group made before bps_gc's init is rank {dist.get_rank()} of "
                                  f"{dist.get_world_size()}; the environment says rank {cfg.rank} of {cfg.size}")
    store = dist.distributed_c10d._get_default_store()
    # the group outlives this init: a script that inits and shuts bps_gc down again on it (one
    # run after another) must not read the last run's endings and beats, so each adoption has
    # keys of its own; every rank runs the same inits in the same order, so the counts agree
    global adoptions
    adoptions += 1
    return dist.PrefixStore(f"{key_prefix()}/live/adopted{adoptions}", store), hosts_store(cfg)


adoptions = 0  # this process's inits on a process group it did not make


def waiting_at_rendezvous(cfg):
    """Lines naming the rendezvous while connect() waits there (wire/waiting.py)."""
    where = f"{cfg.root_uri}:{cfg.root_port}"
    return WaitLines(lambda: f"rank {cfg.rank} of {cfg.size} waiting for the other ranks at the "
                             f"rendezvous at {where}", cfg.join_timeout)
