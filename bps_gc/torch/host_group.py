"""The host's local ranks as torch.distributed's default process group, under ``bpslaunch`` on
the parameter server (one worker process per local rank): what FSDP2 shards a model over
(``host_mesh``, fsdp_ps.py), what DDP keeps a host's replica identical on, and what DiLoCo's
host replicas share their parts of the global copy over (``replicate="hosts"``, diloco_hosts.py).
Its own module: fsdp_ps.py pulls in torch.distributed.fsdp (sympy: about 1 s of CPU).

A script ending on an uncaught error (a peer's NodeFailure, Ctrl-C) may leave a collective of
the group pending (a rank waiting on a host-mate in DiLoCo's all-gather of its parts, with a
Python callback), which would abort the process (status 134) at finalization: bps_gc's exit
handler ends such a process without it (core._shutdown_at_exit)."""
import torch.distributed as dist

import bps_gc.core as core

HOST_GROUP = "bps_gc.host_mesh"  # the send/recv channel of the host group's store address


def host_group(backend=None, caller="host_group"):
    """After ``bps_gc.torch.init()`` on the parameter server: torch.distributed's default
    process group made of this host's local ranks (``backend``: torch's default for the
    device), made now unless it exists (then checked to be it). Local rank 0 opens the group's
    store on a free port and sends its address to the host's other ranks."""
    if not core.is_initialized() or core.communicator().reduces_on_process_groups:
        raise ValueError(f"{caller}: the host's group is made on the parameter-server transport, after "
                         "bps_gc.torch.init(); on torch.distributed use init_device_mesh")
    rank, local_rank, local_size = core.rank(), core.local_rank(), core.local_size()
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (local_rank, local_size):
            raise ValueError(f"{caller}: a default process group of rank {dist.get_rank()} of "
                             f"{dist.get_world_size()} exists, not this host's local rank {local_rank} of {local_size}")
        return dist.group.WORLD
    first = rank - local_rank
    if local_rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, local_size, is_master=True, wait_for_workers=False)
        for peer in range(first + 1, first + local_size):
            core.send(peer, HOST_GROUP, str(store.port).encode())
    else:
        port = int(bytes(core.recv(first, HOST_GROUP)).decode())
        store = dist.TCPStore("127.0.0.1", port, local_size, is_master=False)
    dist.init_process_group(backend, store=store, rank=local_rank, world_size=local_size)
    return dist.group.WORLD

