"""The two exchanges of compressed payloads: an all_gather of byte strings of any length, and
the sum every rank then computes from them, exactly as a parameter server would.

Every rank sees every rank's payloads in rank order, so each can run the server's reduction
itself: decode and add to zeros in rank order, then (reducer ``recompress``) the server chain's
compress/decompress. The server chain is deterministic (its seed derives from the partition
key), so every rank ends with the same bits the parameter server would have sent back.
"""
import numpy as np
import torch
import torch.distributed as dist


def all_gather_bytes(payloads, wait, group=None):
    """``payloads``: this rank's uint8 arrays (one per partition). Returns, for every rank in
    order, its list of payloads. Lengths travel first; the bytes are padded to the longest."""
    size = dist.get_world_size(group)
    lengths = torch.tensor([p.size for p in payloads], dtype=torch.int64)
    all_lengths = [torch.empty_like(lengths) for _ in range(size)]
    wait(dist.all_gather(all_lengths, lengths, group=group, async_op=True), "all_gather of payload sizes")
    totals = [int(t.sum()) for t in all_lengths]
    longest = max(totals)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payloads:
        np.concatenate(payloads, out=mine.numpy()[:totals[dist.get_rank(group)]])
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    wait(dist.all_gather(gathered, mine, group=group, async_op=True), "all_gather of payloads")
    result = []
    for buffer, counts in zip(gathered, all_lengths):
        flat, offsets = buffer.numpy(), np.concatenate([[0], np.cumsum(counts.numpy())])
        result.append([flat[offsets[i]:offsets[i + 1]] for i in range(len(payloads))])
    return result


class PartitionReducer:
    """What the server does with one partition's pushes, run on every rank.

    ``reducer``: ``recompress`` (BytePS: the sum is re-encoded by the server's chain, server
    error feedback included) or ``lossless`` (the exact sum). ``majority`` never gets here: it
    is an all_reduce of signs (communicator.py).
    """

    def __init__(self, codecs, params, n, dtype, key, reducer):
        self.reducer, self.n, self.dtype = reducer, n, np.dtype(dtype)
        self.server = codecs.build_chain(params, n, dtype, key=key, role="server")

    def reduce(self, payloads, lr, out):
        """Sum of the decoded ``payloads`` (rank order) into ``out``; returns ``out``."""
        out[...] = 0
        for payload in payloads:
            self.server.decompress_add(payload, out)
        if self.reducer == "recompress":
            self.server.decompress(self.server.compress(out, lr), out)
        return out
