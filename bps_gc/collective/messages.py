"""Point-to-point messages between ranks on torch.distributed (CHOCO's gossip, the
communicator's send/recv): a length, then the bytes, batched, under a tag derived from the name.
Each message is counted per peer, so a rank that shut down can tell the others which of their
messages it will never send or take (departure.py)."""
import zlib

import numpy as np
import torch
import torch.distributed as dist

from ..comm import communicator as api


class SendHandle(api.Handle):
    def __init__(self, comm, works, tensors, what, message):
        self.comm, self.works, self.tensors, self.what, self.message = comm, works, tensors, what, message

    def poll(self):
        return self.tensors is None  # gloo's send works complete only inside wait()

    def wait(self, timeout=None):
        for work in self.works:
            self.comm.wait(work, self.what, message=self.message)
        self.tensors = None


class Messages:
    """The communicator's send/recv, counted per peer in ``shared.sent`` and ``shared.received``."""

    def __init__(self, shared, lifecycle):
        """``shared``: shared.Shared; ``lifecycle``: its checks and waits (lifecycle.py)."""
        self.sent, self.received = shared.sent, shared.received  # lists, counted in place
        self.check_alive, self.wait = lifecycle.check_alive, lifecycle.wait

    def send(self, rank, name, payload):
        """Length, then bytes, to ``rank`` under a tag derived from ``name`` (gloo keeps their
        order per peer and tag). Returns at once: the handle's ``wait()`` returns once the
        receiver took them (a gloo send needs the matching recv)."""
        self.check_alive()
        array = payload if isinstance(payload, np.ndarray) else np.frombuffer(bytes(payload), np.uint8)
        data = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8).copy())
        length = torch.tensor([data.numel()], dtype=torch.int64)
        tag = _tag(name)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, length, rank, tag=tag),
                                        dist.P2POp(dist.isend, data, rank, tag=tag)])
        self.sent[rank] += 1
        return SendHandle(self, works, (length, data), f"send of {name!r} to rank {rank}", ("send", rank, self.sent[rank]))

    def recv(self, rank, name, timeout=None):
        self.check_alive()
        tag = _tag(name)
        length = torch.zeros(1, dtype=torch.int64)
        what, message = f"recv of {name!r} from rank {rank}", ("recv", rank, self.received[rank] + 1)
        self.wait(dist.irecv(length, rank, tag=tag), what, message)
        data = torch.empty(int(length), dtype=torch.uint8)
        self.wait(dist.irecv(data, rank, tag=tag), what, message)
        self.received[rank] += 1
        return data.numpy()  # like the parameter server's peers, not counted in metrics() (reductions only)


def _tag(name):
    return zlib.crc32(name.encode()) & 0x7FFFFFF
