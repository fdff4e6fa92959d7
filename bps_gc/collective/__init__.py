"""bps_gc.collective: the communicator on torch.distributed (gloo on CPU, NCCL for CUDA tensors,
MPI where torch was built with it) instead of the ZeroMQ parameter server.

Started by ``bps_gc.core.init()`` when the environment asks for it (``config.transport_from_env``):
under torchrun (RANK, WORLD_SIZE, MASTER_ADDR), under bpslaunch with DMLC_NUM_SERVER=0, or with
BPS_GC_TRANSPORT=collective. Like ``ps.worker.worker.Worker`` it is handed the codec library.
"""
from .communicator import Collective
from .all_gather import all_gather_bytes
from .levels import HostLevels, levels_from_env
from .rendezvous import collective_config

__all__ = ["Collective", "HostLevels", "all_gather_bytes", "collective_config", "levels_from_env"]
