"""A gossip communicator over torch.distributed point-to-point (gloo) for tests: lets
DecentralizedOptimizer run on real processes and sockets without bps_gc's own worker-to-worker
links, and gives a second transport to compare them with. Started by torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A message is an int64 length, then the bytes."""
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
        works = [dist.isend(length, rank, tag=self._tag(name)), dist.isend(data, rank, tag=self._tag(name))]
        return _Sent(works, (length, data))

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


class _Sent:
    """Keeps the sent tensors alive until the sends are done."""

    def __init__(self, works, buffers):
        self.works, self.buffers = works, buffers

    def wait(self):
        for w in self.works:
            w.wait()
