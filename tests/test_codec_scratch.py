"""Codecs that share one compress.Scratch (the exchange's, for FSDP2's shards: docs/fsdp.md
"Bytes and memory per codec") give the same bits as codecs keeping their own buffers: the
workers' payloads, the servers' replies (recompress with server error feedback), the decoded
results and the state after every step, over partitions of different sizes run in turn (the
larger ones first, so a smaller one reads a grown buffer), a non-finite step included; and
once released, they hold no buffer beyond their state. A scratch kept across steps (the DDP
hook's) gives the same bits too."""
import numpy as np
import pytest

from bps_gc.compress import CompressionParams, Scratch, build_chain, make_reducer, use_scratch

SIZES = (700, 96, 333)
CODECS = [{"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          {"compressor": "topk", "k": 0.05, "ef": "vanilla"},
          {"compressor": "dithering", "k": 2, "seed": 3, "ef": "vanilla"},
          {"compressor": "randomk", "k": 0.05, "seed": 2, "ef": "vanilla"}]


def parts(params, scratch, device=None):
    """Per partition: (worker chains of 2 workers, the reducer), each handed ``scratch``; with a
    ``device``, the device chains and the device reducer there."""
    made = []
    for key, n in enumerate(SIZES):
        workers = [build_chain(params, n, np.float32, key=key, **({"device": device} if device else {}))
                   for _ in range(2)]
        reduced = CompressionParams.from_dict(params), n, np.float32, key
        if device:
            from bps_gc.compress.device.reducers import device_reduction  # imports torch
            reducer = device_reduction("recompress", *reduced, device)
        else:
            reducer = make_reducer("recompress", *reduced)
        for codec in workers + [reducer]:
            use_scratch(codec, scratch)
        made.append((workers, reducer))
    return made


def step(made, grads, lr):
    """One step of every partition in turn: payloads, reply, decoded result."""
    out = []
    for (workers, reducer), pair in zip(made, grads):
        payloads = [w.compress(g, {"lr": lr}) for w, g in zip(workers, pair)]
        reply = reducer.reduce(payloads, True, {"lr": lr})
        out.append((payloads, reply, reducer.decode(reply, np.empty(reducer.n, np.float32)).copy()))
    return out


def state(made):
    return [[w.state_dict() for w in workers] + [reducer.state_dict()] for workers, reducer in made]


@pytest.mark.parametrize("kept", [False, True], ids=["freed", "kept"])
@pytest.mark.parametrize("params", CODECS, ids=lambda p: p["compressor"])
def test_shared_scratch_gives_the_same_bits(params, kept):
    """Freed after every step (FSDP2's exchange), or kept across steps (the DDP hook's:
    error feedback then swaps its own second buffer with e instead of copying g)."""
    rng = np.random.default_rng(7)
    own, scratch = parts(params, None), Scratch(kept=kept)
    shared = parts(params, scratch)
    for s, lr in enumerate((0.1, 0.1, 0.05, 0.05)):
        grads = [[rng.standard_normal(n).astype(np.float32) for _ in range(2)] for n in SIZES]
        if s == 2:
            grads[1][0][5] = np.inf  # the step is sent as NaN, e kept
        a, b = step(own, grads, lr), step(shared, grads, lr)
        for (pa, ra, da), (pb, rb, db) in zip(a, b):
            assert all(np.array_equal(x, y) for x, y in zip(pa, pb)) and np.array_equal(ra, rb)
            assert np.array_equal(da, db, equal_nan=True)
        assert np.isnan(b[1][2]).any() == (s == 2) and np.isfinite(b[0][2]).all()  # that step shows
        for x, y in zip(state(own), state(shared)):
            for sx, sy in zip(x, y):
                assert sx.keys() == sy.keys()
                assert all(np.array_equal(sx[k], sy[k]) for k in sx)
        assert scratch.nbytes() >= (2 if kept else 4) * max(SIZES)  # the shared buffers were used...
        if not kept:
            scratch.release()
            assert scratch.nbytes() == 0  # ...and hold nothing once released
    for workers, reducer in shared:  # nothing of their own beyond the state (e), or e's swap
        assert all((getattr(w, "_spare", None) is not None) == kept for w in workers) and reducer._acc is None


def test_powersgd_m_from_the_scratch_is_freed():
    """PowerSGD's M (built in compress, read until finish) comes from the shared scratch and is
    let go after finish; the phases' bits equal a codec keeping its own M."""
    rng = np.random.default_rng(3)
    params = {"compressor": "powersgd", "rank": 2}
    scratch = Scratch()
    own = [build_chain(params, n, np.float32, key=k, shape=(n,)) for k, n in enumerate(SIZES)]
    shared = [build_chain(params, n, np.float32, key=k, shape=(n,)) for k, n in enumerate(SIZES)]
    for codec in shared:
        use_scratch(codec, scratch)
    for _ in range(3):
        xs = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
        for pair in (own, shared):
            ps = [c.compress(x) for c, x in zip(pair, xs)]  # every part's P first, as the phases run
            qs = [c.compress_q(p) for c, p in zip(pair, ps)]
            pair_out = [c.finish(q) for c, q in zip(pair, qs)]
            if pair is own:
                want = (ps, qs, pair_out)
        for w, g in zip(want, (ps, qs, pair_out)):
            assert all(np.array_equal(x, y) for x, y in zip(w, g))
        assert all(np.array_equal(a.error, b.error) and np.array_equal(a.q, b.q) for a, b in zip(own, shared))
        assert all(c.m is None for c in shared) and all(c.m is not None for c in own)
        scratch.release()


DEVICE_CODECS = [{"compressor": "onebit", "scaling": True, "ef": "vanilla"},
                 {"compressor": "topk", "k": 0.05, "ef": "vanilla"}]


@pytest.mark.parametrize("kept", [False, True], ids=["freed", "kept"])
@pytest.mark.parametrize("params", DEVICE_CODECS, ids=lambda p: p["compressor"])
def test_device_chains_sharing_a_scratch_give_the_same_bits(params, kept):
    """The device chains (torch operations: a CUDA bucket's, here on CPU tensors) and the device
    recompress reducer take their decoded payloads, sums and (freed after each call) error
    feedback's g from the shared scratch as tensors: the same payloads, results and state as
    each keeping its own, a non-finite step included."""
    import torch

    rng = np.random.default_rng(11)
    scratch = Scratch(kept=kept)
    own, shared = parts(params, None, "cpu"), parts(params, scratch, "cpu")
    for s, lr in enumerate((0.1, 0.05, 0.05)):
        grads = [[rng.standard_normal(n).astype(np.float32) for _ in range(2)] for n in SIZES]
        if s == 1:
            grads[2][1][7] = np.nan
        for (wa, ra), (wb, rb), pair in zip(own, shared, grads):
            pa = [w.compress(torch.from_numpy(g), {"lr": lr}) for w, g in zip(wa, pair)]
            pb = [w.compress(torch.from_numpy(g), {"lr": lr}) for w, g in zip(wb, pair)]
            assert all(torch.equal(x, y) for x, y in zip(pa, pb))
            outs = [torch.empty(ra.n), torch.empty(rb.n)]
            ra.reduce(pa, outs[0], {"lr": lr})
            rb.reduce(pb, outs[1], {"lr": lr})
            assert torch.equal(outs[0].isnan(), outs[1].isnan()) and torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())
        for (wa, ra), (wb, rb) in zip(own, shared):
            for x, y in zip([w.state_dict() for w in wa] + [ra.state_dict()], [w.state_dict() for w in wb] + [rb.state_dict()]):
                assert x.keys() == y.keys()
                assert all(np.array_equal(np.asarray(x[k]), np.asarray(y[k])) for k in x)
        assert scratch.nbytes() >= 4 * max(SIZES)  # the shared tensors were used
        if not kept:
            scratch.release()
    for workers, reducer in shared:  # error feedback's second tensor: its own where kept, else the scratch's
        assert all((w._spare is not None) == kept for w in workers)
