"""bfloat16 on the parameter server's wire (bps_gc/wire/bfloat16.py, wire dtype code 4): a
server's key adds the pushes in float32 and rounds once; FSDP2's dense bfloat16 shards travel
so (tests/test_fsdp_ps.py checks them end to end, docs/fsdp_ps.md)."""
import numpy as np
import pytest
import torch

from bps_gc import compress
from bps_gc.comm.placement import BFLOAT16, check_dtype, declare_tensor
from bps_gc.ps.server.keys import KeyState
from bps_gc.wire.wire import Header, Msg


def test_bfloat16_keys_sum_in_float32():
    """A server's bfloat16 key (wire dtype code 4) adds its pushes in float32 in rank order and
    rounds once, as torch rounds (here 3 pushers, synchronous, then asynchronous: a float32
    store, its snapshots rounded); bfloat16 is refused with a codec or shared by every rank."""
    n, pushes = 1000, [torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10 ** r for r in range(3)]
    bits = [p.to(torch.bfloat16).view(torch.int16).numpy() for p in pushes]
    decl = {"name": "w#shard0#0", "n": n, "params": {}, "pushers": "host"}
    for asynchronous in (False, True):
        state = KeyState(7, decl, BFLOAT16, 3, compress, asynchronous)
        results = []
        for rank in range(3):
            state.check_declaration(decl, BFLOAT16, rank)
            header = Header.unpack(Header(Msg.PUSH, rank, key=7, length=2 * n, dtype=BFLOAT16).pack())
            np.frombuffer(state.buffer_for(rank, header), np.int16)[:] = bits[rank]
            if state.arrive(rank, None, header):
                job = state.take_round()
                results.append(state.compute(job.number, job.ranks).view(np.int16).copy())
        widened = [torch.from_numpy(b).view(torch.bfloat16).float() for b in bits]
        sums = [widened[0], widened[0] + widened[1], widened[0] + widened[1] + widened[2]]
        want = sums if asynchronous else sums[2:]
        assert [r.tobytes() for r in results] == [s.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
                                                  for s in want], asynchronous
    for params, pushed_by in (({"compressor": "topk", "k": 0.1}, 0), ({}, None)):
        tensor, _, _ = declare_tensor({}, compress, "w", (8,), BFLOAT16, None, params, pushed_by=pushed_by)
        with pytest.raises(TypeError, match=r"^'w': bfloat16 is pushed dense, as one local rank's own tensor"):
            check_dtype(tensor, BFLOAT16)
