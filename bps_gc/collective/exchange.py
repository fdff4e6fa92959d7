"""The exchange of compressed payloads: an all_gather of byte strings of any length.

Every rank then sees every rank's payloads in rank order, so each runs the reducer the
parameter server would have run (compress/reducers.py) and decodes its reply. The server chain
is deterministic (its seed derives from the partition key), so every rank ends with the same
bits the parameter server would have sent back.

A rank that could not make its payloads (its codec raised) still takes part: it sends lengths
of -1 and no bytes, so every rank issues the same collectives and learns who failed
(``PayloadsMissing``) instead of waiting for bytes that never come.
"""
import numpy as np
import torch
import torch.distributed as dist


class PayloadsMissing(RuntimeError):
    """Raised on every rank when some rank sent no payloads (``ranks``: which)."""

    def __init__(self, ranks):
        super().__init__(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                         "could not make their payloads")
        self.ranks = ranks


def gather_lengths(payloads, wait, group, parts, device=None):
    """Every rank's payload lengths (lists of ints, rank order): ``payloads`` this rank's (with
    ``.size`` or ``.numel()``), or None when it failed to make them (then ``parts`` says how
    many there would have been, and it sends -1 for each). PayloadsMissing when any rank failed."""
    sizes = [-1] * parts if payloads is None else [int(p.numel() if hasattr(p, "numel") else p.size) for p in payloads]
    lengths = torch.tensor(sizes, dtype=torch.int64, device=device)
    all_lengths = [torch.empty_like(lengths) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(all_lengths, lengths, group=group, async_op=True), "all_gather of payload sizes")
    counts = [t.tolist() for t in all_lengths]
    missing = [r for r, c in enumerate(counts) if any(n < 0 for n in c)]
    if missing:
        raise PayloadsMissing(missing)
    return counts


def all_gather_bytes(payloads, wait, group=None, parts=None):
    """``payloads``: this rank's uint8 arrays (one per partition), or None when this rank
    failed to make them (then ``parts`` says how many there would have been). Returns, for
    every rank in order, its list of payloads. Lengths travel first; the bytes are padded to
    the longest."""
    counts = gather_lengths(payloads, wait, group, parts)
    longest = max(sum(c) for c in counts)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payloads:
        np.concatenate(payloads, out=mine.numpy()[:sum(counts[dist.get_rank(group)])])
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in counts]
    wait(dist.all_gather(gathered, mine, group=group, async_op=True), "all_gather of payloads")
    result = []
    for buffer, c in zip(gathered, counts):
        flat, offsets = buffer.numpy(), np.concatenate([[0], np.cumsum(c)])
        result.append([flat[offsets[i]:offsets[i + 1]] for i in range(len(c))])
    return result


def all_gather_tensors(payloads, wait, group=None, parts=None, device=None):
    """``all_gather_bytes`` for uint8 tensors on one device (the device codec chains'
    payloads): the lengths and the bytes are gathered as tensors there (NCCL for CUDA), so the
    payloads never leave the device; only the lengths are read back, to slice them. A rank
    without payloads (None) names its ``device``."""
    device = payloads[0].device if payloads else device
    counts = gather_lengths(payloads, wait, group, parts, device)
    longest = max(sum(c) for c in counts)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payloads:
        torch.cat([p.reshape(-1) for p in payloads], out=mine[:sum(counts[dist.get_rank(group)])])
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in counts]
    wait(dist.all_gather(gathered, mine, group=group, async_op=True), "all_gather of payloads")
    return [list(buffer.split(c + [longest - sum(c)])[:len(c)]) for buffer, c in zip(gathered, counts)]
