"""A gossip communicator over torch.distributed point-to-point (gloo) for tests: lets
DecentralizedOptimizer run on real processes and sockets without bps_gc's own worker-to-worker
links, and gives a second transport to compare them with. Started by torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A message is an int64 length, then the bytes; a send
returns once the receiver has it (gloo's point-to-point semantics)."""
import zlib

import numpy as np
import torch
import torch.distributed as dist


class GlooComm:
    def __init__(self):
        dist.init_process_group("gloo")

    def rank(self):
        return dist.get_rank()

    def size(self):
        return dist.get_world_size()

    @staticmethod
    def _tag(name):
        return zlib.crc32(name.encode()) & 0x7FFF

    def send(self, rank, name, payload):
        data = torch.from_numpy(np.array(payload, np.uint8).reshape(-1))
        length = torch.tensor([data.numel()], dtype=torch.int64)
        # blocks until the neighbour receives, like bps_gc.collective's send
        for work in [dist.isend(length, rank, tag=self._tag(name)), dist.isend(data, rank, tag=self._tag(name))]:
            work.wait()

    def recv(self, rank, name, timeout=None):
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, rank, tag=self._tag(name))
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(data, rank, tag=self._tag(name))
        return data.numpy()

    def average(self, name, array):
        t = torch.from_numpy(array)
        dist.all_reduce(t)
        t /= self.size()
        return array

    def shutdown(self):
        dist.barrier()
        dist.destroy_process_group()

