"""The exchange of compressed payloads: an all_gather of byte strings of any length.

Every rank then sees every rank's payloads in rank order, so each runs the reducer the
parameter server would have run (compress/reducers.py) and decodes its reply. The server chain
is deterministic (its seed derives from the partition key), so every rank ends with the same
bits the parameter server would have sent back.
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


def all_gather_tensors(payloads, wait, group=None):
    """``all_gather_bytes`` for uint8 tensors on one device (the device codec chains'
    payloads): the lengths and the bytes are gathered as tensors there (NCCL for CUDA), so the
    payloads never leave the device; only the lengths are read back, to slice them."""
    size = dist.get_world_size(group)
    device = payloads[0].device
    lengths = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=device)
    all_lengths = [torch.empty_like(lengths) for _ in range(size)]
    wait(dist.all_gather(all_lengths, lengths, group=group, async_op=True), "all_gather of payload sizes")
    counts = [t.tolist() for t in all_lengths]
    longest = max(sum(c) for c in counts)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    torch.cat([p.reshape(-1) for p in payloads], out=mine[:sum(counts[dist.get_rank(group)])])
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    wait(dist.all_gather(gathered, mine, group=group, async_op=True), "all_gather of payloads")
    return [list(buffer.split(c + [longest - sum(c)])[:len(payloads)]) for buffer, c in zip(gathered, counts)]
