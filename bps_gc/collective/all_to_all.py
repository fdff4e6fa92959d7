"""The all_to_all of payloads of any length, each sent to the one rank that reduces its part
(a reduce-scatter's exchange: FSDP2's in-host step, docs/fsdp_inhost.md): where the all_gather
(all_gather.py) hands every rank every payload, this hands rank j only the payloads of the
parts it reduces, so each rank receives 1/S of what the all_gather brings (S: the group's size).

One ``all_to_all_single`` of equal blocks, one per peer: each block carries a header (the
sender's largest block, then the lengths of the payloads for that peer) and the first
``capacity.bytes`` of those payloads, zero-padded. A rank's payloads of its own parts stay out
of the collective (its block to itself carries the header alone) and are handed back as they
are: they may be any object (coded.Exact: the values themselves). Every rank learns every
sender's largest block from the headers it receives, so all agree on the capacity and on
whether a second all_to_all (the rest, padded to the longest rest) is needed. A rank that could not make its
payloads sends -1 in place of its largest block, and every rank raises PayloadsMissing.
"""
import numpy as np
import torch
import torch.distributed as dist

from .all_gather import PayloadsMissing, payload_length

WORD = 8  # bytes of a header entry (int64)


def all_to_all_bytes(payloads, destinations, wait, group=None, capacity=None, device=None):
    """``payloads``: this rank's, one per part (uint8 numpy arrays, or uint8 tensors on one
    device), or None when this rank failed to make them; ``destinations``: each part's rank in
    ``group`` (the one that reduces it, the same list on every rank). Returns, for every rank
    of the group in order, a list with a payload per part: that rank's payload of each part
    this rank reduces, None for the others. ``capacity``: an all_gather.Capacity (None: the
    headers go alone first, two collectives always); ``device``: where tensor payloads are
    exchanged when this rank has none."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if any(not 0 <= d < size for d in destinations):  # every rank has the same: all raise here
        raise ValueError(f"all_to_all_bytes: destinations {sorted(set(destinations))} outside a group of {size}")
    to = [[i for i, d in enumerate(destinations) if d == peer] for peer in range(size)]  # each peer's parts
    sent = [parts if peer != me else [] for peer, parts in enumerate(to)]  # its own parts stay here
    on_device = device is not None or bool(payloads) and isinstance(payloads[0], torch.Tensor)
    device = (device if device is not None else payloads[0].device) if on_device else None
    head = WORD * (1 + max(len(parts) for parts in to))
    sizes = [[-1 if payloads is None else int(payload_length(payloads[i])) for i in parts] for parts in sent]
    first = capacity.bytes if capacity is not None else 0
    mine, into = _blocks(size, head + first, device)
    headers = into[:, :head].view(np.int64) if not on_device else np.zeros((size, head // WORD), np.int64)
    headers[:, 0] = -1 if payloads is None else max(sum(s) for s in sizes)  # the sender's longest block
    for peer, s in enumerate(sizes):
        headers[peer, 1:1 + len(s)] = s
    if on_device:
        mine[:, :head] = torch.from_numpy(headers.view(np.uint8)).to(device)
    if payloads is not None:
        for peer, parts in enumerate(sent):
            _copy([payloads[i] for i in parts], into[peer, head:], 0, first)
    theirs, received = _blocks(size, head + first, device)
    wait(dist.all_to_all_single(theirs, mine, group=group, async_op=True),
         "all_to_all of payloads" if first else "all_to_all of payload sizes")
    # [sender, (its longest block, the lengths of its payloads for this rank)]
    lengths = (received[:, :head] if not on_device else theirs[:, :head].cpu().numpy()).view(np.int64)
    missing = [r for r in range(size) if lengths[r, 0] < 0]
    if missing:
        raise PayloadsMissing(missing)
    longest = int(lengths[:, 0].max())
    if capacity is not None:
        capacity.learn(longest)
    blocks = [received[r, head:] for r in range(size)]
    if longest > first or capacity is None:  # the rest, padded to the longest rest (without a
        # capacity always: two collectives, as the all_gather's callers count them)
        rest, into = _blocks(size, longest - first, device)
        if payloads is not None:
            for peer, parts in enumerate(sent):
                _copy([payloads[i] for i in parts], into[peer], first, longest)
        tails, tail_blocks = _blocks(size, longest - first, device)
        wait(dist.all_to_all_single(tails, rest, group=group, async_op=True), "all_to_all of payloads")
        blocks = [_joined(b, t) for b, t in zip(blocks, tail_blocks)] if first else list(tail_blocks)
    result = []
    for sender, buffer in enumerate(blocks):
        row, offset = [None] * len(destinations), 0
        if sender == me:
            for i in to[me]:
                row[i] = payloads[i]
            result.append(row)
            continue
        for k, i in enumerate(to[me]):
            n = int(lengths[sender, 1 + k])
            row[i] = buffer[offset:offset + n]
            offset += n
        result.append(row)
    return result


def _blocks(size, block, device):
    """A zeroed (size, block) uint8 tensor for a collective, and what is written and read in it:
    itself on a device, its numpy view on the host."""
    tensor = torch.zeros(size, block, dtype=torch.uint8, device=device)
    return tensor, (tensor if device is not None else tensor.numpy())


def _joined(head, tail):
    return torch.cat([head, tail]) if isinstance(head, torch.Tensor) else np.concatenate([head, tail])


def _copy(payloads, out, start, stop):
    """Bytes [start, stop) of ``payloads`` laid end to end, into ``out`` (uint8, numpy for numpy
    payloads, else a tensor on their device, of stop - start bytes or more)."""
    offset = 0
    for payload in payloads:
        n = int(payload_length(payload))
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            flat = payload.reshape(-1)
            out[lo - start:hi - start] = flat[lo - offset:hi - offset]
        offset += n
