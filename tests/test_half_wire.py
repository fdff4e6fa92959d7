"""float16 and bfloat16 on the parameter server's wire (bps_gc/wire/half.py, wire dtype codes 2
and 4): a server's key adds the pushes in float32 and rounds once, after dividing by the round's
pushers when they ask (``SERVER_MEAN``: every averaged dense half tensor the servers sum as
pushed); FSDP2's dense float16 and bfloat16 shards travel so (tests/test_fsdp_ps.py checks them
end to end on 2 hosts, docs/fsdp_ps.md). The oracle is torch's float32 arithmetic and its
rounding (``.to()``), or numpy's for the tensors every worker pushes."""
import os
import sys

import numpy as np
import pytest
import torch

from bps_gc import compress
from bps_gc.comm.placement import BFLOAT16, check_dtype, declare_tensor
from bps_gc.ps.server.keys import KeyState
from bps_gc.wire import shm
from bps_gc.wire.half import SERVER_MEAN
from bps_gc.wire.wire import Header, Msg
from cluster import run_local

HALVES = {"float16": (np.dtype(np.float16), torch.float16), "bfloat16": (BFLOAT16, torch.bfloat16)}


def as_torch(bits, dtype):
    """A half array's (or its uint16 bits') values as a torch tensor of that dtype."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(dtype)


def bits_of(tensor):
    return tensor.view(torch.int16).numpy().tobytes()


def pushes_of(dtype, n=1000, pushers=3):
    """Each pusher's values in ``dtype``: widely spread magnitudes (float16's subnormals too)."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 3, (n,), generator=g)).to(dtype)
            for _ in range(pushers)]


def server_rounds(np_dtype, pushes, asynchronous, mean=False):
    """What one server key answers for ``pushes`` (one per pusher, in rank order): each round's
    reply as its bytes."""
    n = pushes[0].numel()
    decl = {"name": "w#shard0#0", "n": n, "params": {}, "pushers": "host"}
    state = KeyState(7, decl, np_dtype, len(pushes), compress, asynchronous)
    replies = []
    for rank, push in enumerate(pushes):
        state.check_declaration(decl, np_dtype, rank)
        header = Header.unpack(Header(Msg.PUSH, rank, key=7, length=2 * n, dtype=np_dtype,
                                      ctx={SERVER_MEAN: True} if mean else None).pack())
        np.frombuffer(state.buffer_for(rank, header), np.int16)[:] = push.view(torch.int16).numpy()
        if state.arrive(rank, None, header):
            job = state.take_round()
            replies.append(state.compute(job.number, job.ranks).view(np.int16).tobytes())
    return replies


@pytest.mark.parametrize("half", HALVES)
def test_half_keys_sum_in_float32_and_average_before_rounding(half):
    """A server's float16 or bfloat16 key adds its 3 pushes in float32 in rank order and rounds
    once, as torch rounds (synchronous; asynchronous: a float32 store, its snapshots rounded);
    asked for the mean, it divides the float32 sum by its 3 pushers before that one rounding,
    which a worker dividing the rounded sum misses in about one element in five (a double
    rounding); bfloat16 is refused with
    a codec or shared by every rank."""
    np_dtype, dtype = HALVES[half]
    pushes = pushes_of(dtype)
    widened = [p.float() for p in pushes]
    sums = [widened[0], widened[0] + widened[1], widened[0] + widened[1] + widened[2]]
    assert server_rounds(np_dtype, pushes, False) == [bits_of(sums[2].to(dtype))]
    stored = [torch.zeros(1000) + sums[0], torch.zeros(1000) + sums[0] + widened[1]]  # async: -0.0 added to +0.0
    stored.append(stored[1] + widened[2])
    assert server_rounds(np_dtype, pushes, True) == [bits_of(s.to(dtype)) for s in stored]
    mean = (sums[2] / 3).to(dtype)
    assert server_rounds(np_dtype, pushes, False, mean=True) == [bits_of(mean)]
    twice = (sums[2].to(dtype).float() / 3).to(dtype)  # the worker dividing the rounded sum
    assert 0.15 < (twice.view(torch.int16) != mean.view(torch.int16)).float().mean() < 0.3  # 22%, 20%
    # adding in the half dtype, rounding after each push, is not what the servers do
    assert bits_of(sums[2].to(dtype)) != bits_of(((pushes[0] + pushes[1]) + pushes[2]))
    if half == "bfloat16":
        for params, pushed_by in (({"compressor": "topk", "k": 0.1}, 0), ({}, None)):
            tensor, _, _ = declare_tensor({}, compress, "w", (8,), BFLOAT16, None, params, pushed_by=pushed_by)
            with pytest.raises(TypeError, match=r"^'w': bfloat16 is pushed dense, as one local rank's own tensor"):
                check_dtype(tensor, BFLOAT16)


JOB = """
import sys, numpy as np, bps_gc.core as bps
from bps_gc.wire.bfloat16 import BFLOAT16
bps.init()
rank, out, arrays = bps.rank(), sys.argv[1], {}
rng = np.random.default_rng(rank)
# "big": over 64 KiB, pushed alone (through the server's shared memory); "small": fused
tensors = [(f"{kind}-{size}", dtype, n) for kind, dtype in (("f16", np.float16), ("bf16", BFLOAT16))
           for size, n in (("big", 40_000), ("small", 1000))] + [("fp16-wire", np.float32, 1000)]
tensors += [("f16-every", np.float16, 2000), ("bf16-every", BFLOAT16, 2000)]  # every worker's own push
for name, dtype, n in tensors:  # "fp16-wire": float32, pushed and pulled as float16 (BytePS's fp16)
    bps.declare(name, shape=(n,), dtype=dtype, one_per_host="every" not in name, fp16=name == "fp16-wire")
for average in (True, False):
    bps.metrics()  # the second round's: every INIT_ACK (a slot taken) came before the first's replies
    handles = []
    for name, dtype, n in tensors:
        values = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3, n)).astype(np.float32)
        # bfloat16: float32's top 16 bits (any bfloat16 values will do)
        top = (values.view(np.uint32) >> 16).astype(np.uint16)
        x = values.astype(dtype) if dtype != BFLOAT16 else top.view(BFLOAT16)
        arrays[f"{name}/{average}/in"] = x.copy()
        handles.append((name, bps.push_pull(x, name, average=average)))
    for name, h in handles:
        arrays[f"{name}/{average}/out"] = h.wait().copy()
arrays["shared_bytes"] = np.array(bps.metrics().shared_bytes)
np.savez(f"{out}/rank{rank}.npz", **arrays)
bps.shutdown()
"""


@pytest.mark.skipif(not shm.supported(), reason="needs Linux memfd and /proc")
def test_three_hosts_average_rounded_once_through_shared_memory(tmp_path):
    """3 hosts (one rank each) and a server on their host: float16 and bfloat16 tensors of one
    local rank's own (``one_per_host``, as FSDP's shards) averaged and summed, each rank's
    result the float32 sum over the hosts in rank order (divided by 3 for the average) rounded
    once by torch, bit for bit (a float32 tensor with BytePS's fp16 wire too: its float16 mean
    widened); the tensors over 64 KiB went through the server's shared memory (the slot each
    worker offers, the result buffers of the server's arena), the small ones fused over the
    socket. Beside them, a float16 and a bfloat16 tensor every worker pushes
    (``check_every_workers_mean``)."""
    result = run_local([sys.executable, "-c", JOB, str(tmp_path)], workers=3, servers=1, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    ranks = [dict(np.load(os.path.join(tmp_path, f"rank{r}.npz"), allow_pickle=False)) for r in range(3)]
    for name in ("f16-big", "f16-small", "bf16-big", "bf16-small", "fp16-wire"):
        dtype = HALVES["bfloat16" if name.startswith("bf16") else "float16"][1]
        for average in (True, False):
            given = [ranks[r][f"{name}/{average}/in"] for r in range(3)]
            inputs = [torch.from_numpy(x).to(dtype).float() if x.dtype == np.float32 else as_torch(x, dtype).float()
                      for x in given]
            total = inputs[0] + inputs[1] + inputs[2]
            want = (total / 3 if average else total).to(dtype)
            # "fp16-wire": the float16 reply widened into the float32 tensor
            want = want.float().numpy().tobytes() if name == "fp16-wire" else bits_of(want)
            for r in range(3):
                assert ranks[r][f"{name}/{average}/out"].tobytes() == want, (name, average, r)
    # the second round's pushes in the slots: the two big tensors' bytes, none of the small ones'
    assert [int(ranks[r]["shared_bytes"]) for r in range(3)] == [2 * 2 * 40_000] * 3
    check_every_workers_mean(ranks)


def round_half(values, half):
    """numpy's oracle of torch's rounding of float32 ``values``: float16's cast, or bfloat16's
    nearest, ties to even, on the float32 bits (no NaN here); the bits as uint16."""
    if half == "float16":
        return values.astype(np.float16).view(np.uint16)
    word = values.view(np.uint32)
    return ((word + np.uint32(0x7FFF) + ((word >> 16) & 1)) >> 16).astype(np.uint16)


def widen_half(bits, half):
    bits = np.ascontiguousarray(bits).view(np.uint16)
    return bits.view(np.float16).astype(np.float32) if half == "float16" else \
        (bits.astype(np.uint32) << 16).view(np.float32)


def check_every_workers_mean(ranks):
    """Tensors every worker pushes (not ``one_per_host``), averaged: the servers divide the
    float32 sum over the 3 workers in rank order by 3 and round once, where the worker dividing
    the rounded sum would round twice (which differs here, so the test can fail)."""
    for name, half in (("f16-every", "float16"), ("bf16-every", "bfloat16")):
        for average in (True, False):
            inputs = [widen_half(ranks[r][f"{name}/{average}/in"], half) for r in range(3)]
            total = (inputs[0] + inputs[1]) + inputs[2]
            want = round_half(total / np.float32(3) if average else total, half)
            for r in range(3):
                assert ranks[r][f"{name}/{average}/out"].view(np.uint16).tobytes() == want.tobytes(), \
                    (name, average, r)
            if average:
                twice = round_half(widen_half(round_half(total, half), half) / np.float32(3), half)
                assert (twice != want).sum() > 0, name
