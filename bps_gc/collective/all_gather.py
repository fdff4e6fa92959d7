"""The all_gather of payloads of any length: host byte strings (``all_gather_bytes``) or uint8
tensors on a device (``all_gather_tensors``). Only the gather: the compressed exchange's stages
around it (compress each part, gather, reduce and decode) are coded.py's.

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


def payload_length(payload):
    """A payload's bytes: a uint8 numpy array or torch tensor (on any device)."""
    return payload.numel() if isinstance(payload, torch.Tensor) else payload.nbytes


def payload_bytes(payloads):
    """The bytes of numpy or torch payloads (None: one not here)."""
    return sum(payload_length(p) for p in payloads or () if p is not None)


def gather_lengths(payloads, wait, group, parts, device=None):
    """Every rank's payload lengths (lists of ints, rank order): ``payloads`` this rank's (with
    uint8 arrays or tensors), or None when it failed to make them (then ``parts`` says how
    many there would have been, and it sends -1 for each). PayloadsMissing when any rank failed."""
    sizes = [-1] * parts if payloads is None else [int(payload_length(p)) for p in payloads]
    lengths = torch.tensor(sizes, dtype=torch.int64, device=device)
    all_lengths = [torch.empty_like(lengths) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(all_lengths, lengths, group=group, async_op=True), "all_gather of payload sizes")
    counts = [t.tolist() for t in all_lengths]
    missing = [r for r, c in enumerate(counts) if any(n < 0 for n in c)]
    if missing:
        raise PayloadsMissing(missing)
    return counts


class Capacity:
    """How many payload bytes each rank sends in the same all_gather as its lengths
    (``all_gather_bytes(..., capacity=)``): the largest total any rank sent in the last few
    gathers of the same payloads. Every rank learns it from the same gathered lengths, so it
    agrees on every rank. Fixed-size payloads (topk, onebit...) then need one all_gather;
    longer ones than that send the rest in a second."""

    REMEMBERED = 4  # gathers: payloads whose size varies (DGC) pad to the recent longest

    def __init__(self):
        self.bytes, self.recent = 0, []

    def learn(self, longest):
        self.recent = self.recent[-(self.REMEMBERED - 1):] + [longest]
        self.bytes = max(self.recent)


def all_gather_bytes(payloads, wait, group=None, parts=None, capacity=None):
    """``payloads``: this rank's uint8 arrays (one per partition), or None when this rank
    failed to make them (then ``parts`` says how many there would have been). Returns, for
    every rank in order, its list of payloads. One all_gather carries each rank's lengths (int64,
    -1 when it failed) and the first ``capacity.bytes`` of its payloads (zero-padded); a second
    the rest of the longest, when there is any. Without ``capacity`` the first carries the
    lengths only (two collectives, always)."""
    parts = len(payloads) if payloads is not None else parts
    sizes = [-1] * parts if payloads is None else [int(payload_length(p)) for p in payloads]
    head, first = 8 * parts, capacity.bytes if capacity is not None else 0
    mine = torch.zeros(head + first, dtype=torch.uint8)
    mine.numpy()[:head].view(np.int64)[:] = sizes
    total = sum(sizes) if payloads is not None else 0
    if payloads and total <= first:  # all of it goes with the lengths
        np.concatenate(payloads, out=mine.numpy()[head:head + total])
    flat = None
    if payloads and 0 < first < total:  # split over the two gathers
        flat = np.concatenate(payloads)
        mine.numpy()[head:] = flat[:first]
    heads = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(heads, mine, group=group, async_op=True),
         "all_gather of payloads" if first else "all_gather of payload sizes")
    counts = [h.numpy()[:head].view(np.int64).tolist() for h in heads]
    missing = [r for r, c in enumerate(counts) if any(n < 0 for n in c)]
    if missing:
        raise PayloadsMissing(missing)
    longest = max(sum(c) for c in counts)
    if capacity is not None:
        capacity.learn(longest)
    flats = [h.numpy()[head:] for h in heads]
    if longest > first or capacity is None:  # the rest, padded to the longest rest (without a
        # capacity always: its callers count two collectives, even for empty payloads)
        rest = torch.zeros(longest - first, dtype=torch.uint8)
        if flat is not None:
            rest.numpy()[:total - first] = flat[first:]
        elif payloads and not first:
            np.concatenate(payloads, out=rest.numpy()[:total])
        tails = [torch.empty_like(rest) for _ in heads]
        wait(dist.all_gather(tails, rest, group=group, async_op=True), "all_gather of payloads")
        flats = [t.numpy() if not first else np.concatenate([f, t.numpy()]) for f, t in zip(flats, tails)]
    result = []
    for buffer, c in zip(flats, counts):
        offsets = np.concatenate([[0], np.cumsum(c)])
        result.append([buffer[offsets[i]:offsets[i + 1]] for i in range(len(c))])
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
