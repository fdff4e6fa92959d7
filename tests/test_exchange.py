"""The compressed exchange (bps_gc.torch.CompressedExchange) serves any process group and
keeps each part's codec under its name: 4 gloo ranks (bpslaunch --servers 0: no torchrun agent) form two groups of 2, each
averaging its own named tensors with a compressed codec; every result equals the numpy
re-computation over that group's ranks alone, with each name's chains seeded by its name
(the parts come in another order at step 1). Bad calls are refused, naming the problem."""
import numpy as np
import pytest
import torch

from collective_cluster import run_torchrun_job

from bps_gc.collective.coded import CodedPart, Exact, compress_parts, reduce_parts
from bps_gc.compress import build_chain
from bps_gc.compress.device.reducers import device_reduction
from bps_gc.compress.params import CompressionParams
from bps_gc.compress.reducers import make_reducer
from bps_gc.compress.stateful import StateError, StateGroup
from bps_gc.torch.exchange import CompressedExchange
from bps_gc.collective.exchange.codecs import name_key

GROUPS = [[0, 1], [2, 3]]
SHAPES = {"fc.weight": [30, 20], "fc.bias": [30], "out.weight": [7, 30]}
CODECS = {"topk": {"compressor": "topk", "k": 0.25, "ef": "vanilla"},
          "onebit": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          "powersgd": {"compressor": "powersgd", "rank": 2}}
STEPS, LR = 3, 0.1


def gradient(rank, name, step, shape):
    return np.random.default_rng([rank, step, sum(name.encode())]).standard_normal(shape).astype(np.float32)


def expected(params, ranks, name, shape):
    """Each step's average over ``ranks`` of ``name``: every rank's worker chain (seeded by the
    name), decoded and summed in rank order, re-compressed by the server's chain, divided;
    PowerSGD (viewing the tensor in its shape): every rank's P summed, then every rank's Q, and
    the finish."""
    n, key = int(np.prod(shape)), name_key(name)
    workers = [build_chain(params, n, np.float32, key=key, rank=r, shape=shape) for r in ranks]
    server = build_chain(params, n, np.float32, key=key, role="server", shape=shape)
    results = []
    for step in range(STEPS):
        ctx = {"lr": LR, "step": step}
        inputs = [gradient(r, name, step, shape).reshape(-1) for r in ranks]
        if params["compressor"] == "powersgd":
            p_sum = sum(chain.compress(x, ctx).view(np.float32) for chain, x in zip(workers, inputs))
            q_sum = sum(chain.compress_q(p_sum).view(np.float32) for chain in workers)
            acc = np.empty(n, np.float32)
            for chain in workers:  # each rank's finish keeps its own error for the next step
                chain.finish(q_sum, acc, len(ranks))
        else:
            acc = np.zeros(n, np.float32)
            for chain, x in zip(workers, inputs):
                acc += chain.decompress(chain.compress(x, ctx))
            acc = server.decompress(server.compress(acc, ctx))
        results.append((acc / np.float32(len(ranks))).reshape(shape))
    return results


def test_exchange_on_two_sub_groups_equals_numpy(tmp_path):
    spec = {"groups": GROUPS, "shapes": SHAPES, "codecs": CODECS, "steps": STEPS, "lr": LR, "all_to_all": ALL_TO_ALL}
    run_torchrun_job("exchange_subgroup_job.py", spec, tmp_path, 4, launcher="bpslaunch")
    got = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(4)]
    each_payload_reaches_its_destination_alone(got)
    for codec, params in CODECS.items():
        for ranks in GROUPS:
            for name, shape in SHAPES.items():
                for step, want in enumerate(expected(params, ranks, name, shape)):
                    for r in ranks:
                        np.testing.assert_array_equal(got[r][f"{codec}/{step}/{name}"], want,
                                                      err_msg=f"{codec} step {step} {name} rank {r}")
    # the two groups really reduced apart: their averages differ
    assert not np.array_equal(got[0]["topk/0/fc.bias"], got[2]["topk/0/fc.bias"])


# the all_to_all of payloads (each part's payload to its destination's group rank alone): its
# parts' lengths (+ the sender's global rank) at each call, growing past what the capacity learnt
ALL_TO_ALL = {"destinations": [1, 0, 1], "lengths": [[3, 0, 5], [10, 2, 1], [40, 7, 30]]}


def each_payload_reaches_its_destination_alone(got):
    """Every rank received its parts' payloads from each rank of its group, byte for byte as
    sent (numpy arrays, then tensors; the second call's longer than the first's capacity, the
    third's longer still), its own as they were, and nothing of the others' parts; its capacity
    the longest block any rank sent a peer (its own parts stay out of the collective); a rank
    without payloads named on both."""
    for ranks in GROUPS:
        for me, r in enumerate(ranks):
            for call, lengths in enumerate(ALL_TO_ALL["lengths"]):
                for sender, s in enumerate(ranks):
                    here = [to == me for to in ALL_TO_ALL["destinations"]]
                    assert got[r][f"a2a/{call}/{sender}/here"].tolist() == here, (r, call, sender)
                    for part, n in enumerate(lengths):
                        if here[part]:
                            want = np.full(n + s, 16 * s + 4 * part + call, np.uint8)
                            assert got[r][f"a2a/{call}/{sender}/{part}"].tobytes() == want.tobytes(), (r, call, part)
                blocks = [sum(n + s for n, to in zip(lengths, ALL_TO_ALL["destinations"]) if to == peer)
                          for sender, s in enumerate(ranks) for peer in (0, 1) if peer != sender]
                assert int(got[r][f"a2a/{call}/capacity"]) == max(blocks), (r, call)
            assert str(got[r]["a2a/missing"]) == "rank 1 could not make their payloads", r


@pytest.mark.parametrize("tensors, message", [
    ({}, "no tensors"),
    ({"": torch.zeros(3)}, "non-empty string name"),
    ({"a": torch.zeros(3, dtype=torch.int64)}, "floating-point"),
    ({"a": torch.zeros(3), "b": torch.zeros(3, dtype=torch.float64)}, "mix dtypes"),
    ([("a", torch.zeros(3)), ("a", torch.zeros(2))], "names repeat"),
])
def test_bad_calls_are_refused_naming_the_problem(tensors, message):
    with pytest.raises(ValueError, match=message):
        CompressedExchange({"compressor": "topk", "k": 0.5})(tensors)


def test_seed_rank_seeds_the_codecs_draws():
    """``seed_rank`` (the parameter server's in-host step passes the job's rank: its host group's
    ranks repeat on every host) is the rank thc's rounding draws by, not the process group's."""
    params, n = {"compressor": "thc", "bits": 4}, 40
    tensor = torch.zeros(n)
    own = {}
    for seed_rank in (None, 3):
        exchange = CompressedExchange(params, "thc", named_parameters=[("w", tensor)], seed_rank=seed_rank)
        codecs = exchange.hook.pipeline.codecs
        own[seed_rank] = codecs._make_codec(name_key("w"), n, tensor, False, np.dtype(np.float32)).chain.rng_state
    drawn = {r: build_chain(params, n, np.float32, key=name_key("w"), rank=r).rng_state for r in (0, 3)}
    assert np.array_equal(own[None], drawn[0])  # no process group here: rank 0
    assert np.array_equal(own[3], drawn[3]) and not np.array_equal(drawn[0], drawn[3])


def test_a_part_saved_with_a_kept_reducer_loads_with_it():
    """Pipeline.keep_saved_reducers: a checkpoint's part reduced by another reducer than the
    exchange's ("recompress": the in-host step's before it summed exactly, fsdp_inhost.py) loads
    with that reducer and its state (the server chain's residual) where the exchange keeps it,
    and is refused naming the setting where it does not."""
    params, n, tensor = CODECS["topk"], 40, torch.zeros(40)
    old = CompressedExchange(params, "recompress", named_parameters=[("w", tensor)])
    saved = old.hook.pipeline.codecs._make_codec(name_key("w"), n, tensor, False, np.dtype(np.float32))
    ctx = {"lr": 0.0, "step": 0}
    pushes = [saved.chain.compress(x, ctx) for x in np.random.default_rng(0).standard_normal((2, n)).astype(np.float32)]
    saved.reducer.reduce(pushes, True, ctx)  # two pushes' top-k, re-compressed: its server chain's residual
    sd = StateGroup({"w": saved}).state_dict()
    assert np.count_nonzero(sd["w/reducer/chain.ef.error"]) > 0
    for kept in (True, False):
        new = CompressedExchange(params, "lossless", named_parameters=[("w", tensor)])
        if kept:
            new.hook.pipeline.keep_saved_reducers(["recompress"])
        fresh, install = new.hook.codec_state_to_load(sd)
        if not kept:
            with pytest.raises(StateError, match="'w/reducer/reducer' is 'recompress' in the state, 'lossless' here"):
                fresh.load_state_dict(sd)
            continue
        fresh.load_state_dict(sd)
        install()
        (loaded,) = new.hook.pipeline.codecs.codecs.values()
        assert loaded.reducer.name == "recompress" and loaded.steps == saved.steps
        assert np.array_equal(loaded.reducer.state_dict()["chain.ef.error"], sd["w/reducer/chain.ef.error"])


@pytest.mark.parametrize("device_chains", [False, True])
def test_a_part_reduced_alone_sums_its_own_values_as_they_are(device_chains):
    """Under reduce_at, the rank that reduces a part alone with the exact sum keeps no worker
    chain of it (no residual) and its own payload is its values (coded.Exact): the result is
    those values plus the peers' decoded payloads in rank order, divided (3 ranks, this one
    rank 1), as numpy recomputes it; on device chains too (torch tensors on the CPU)."""
    params, n, key = CODECS["topk"], 40, name_key("w")
    x = np.random.default_rng(7).standard_normal((3, n)).astype(np.float32)
    peers = {r: build_chain(params, n, np.float32, key=key, rank=r) for r in (0, 2)}
    ctx = {"lr": 0.0, "step": 0}
    payloads = {r: chain.compress(x[r], ctx) for r, chain in peers.items()}
    want = x[1].copy()
    for r in (0, 2):
        want += peers[r].decompress(payloads[r])
    want /= np.float32(3)
    wire, bare = np.dtype(np.float32), CompressionParams.from_dict(params)
    if device_chains:
        reducer = device_reduction("lossless", bare, n, wire, key, torch.device("cpu"))
        flat, sent = torch.from_numpy(x[1].copy()), {r: torch.from_numpy(p) for r, p in payloads.items()}
    else:
        reducer, flat, sent = make_reducer("lossless", bare, n, wire, key), x[1].copy(), payloads
    part = CodedPart(0, n, None, reducer)
    (own,) = compress_parts([part], flat, ctx)
    assert isinstance(own, Exact)
    reduce_parts([part], [[sent[0]], [own], [sent[2]]], flat, ctx, 3)
    np.testing.assert_array_equal(flat.numpy() if device_chains else flat, want)
    tensor = torch.zeros(n)
    for reducer, exact in (("lossless", True), ("recompress", False), ("majority", False)):
        exchange = CompressedExchange(CODECS["onebit"], reducer, named_parameters=[("w", tensor), ("v", tensor)])
        exchange.hook.pipeline.reduce_at(lambda name: int(name == "v"), 1)
        codecs = exchange.hook.pipeline.codecs
        assert codecs.sums_own_exactly("v") == exact and not codecs.sums_own_exactly("w"), reducer


def test_a_part_saved_with_its_own_chain_loads_with_it():
    """A checkpoint of a part this rank reduces alone, saved while its own values were still
    compressed (a worker chain and its residual, before 2026-12-01), loads with that chain and
    state, and resumes as it ran; one saved without (now) loads without a chain."""
    params, n, tensor = CODECS["topk"], 40, torch.zeros(40)

    def exchange():
        made = CompressedExchange(params, "lossless", named_parameters=[("w", tensor)])
        made.hook.pipeline.reduce_at(lambda name: 0, 0)
        return made
    codecs = exchange().hook.pipeline.codecs
    old = codecs._make_codec(name_key("w"), n, tensor, False, np.dtype(np.float32))
    old.chain.compress(np.random.default_rng(1).standard_normal(n).astype(np.float32), {"lr": 0.0, "step": 0})
    new = codecs._make_codec(name_key("w"), n, tensor, False, np.dtype(np.float32), exact=True)
    for saved, chained in ((old, True), (new, False)):
        sd = StateGroup({"w": saved}).state_dict()
        assert ("w/worker/ef.error" in sd) == chained
        loading = exchange()
        fresh, install = loading.hook.codec_state_to_load(sd)
        fresh.load_state_dict(sd)
        install()
        (loaded,) = loading.hook.pipeline.codecs.codecs.values()
        assert (loaded.chain is not None) == chained and loaded.reducer.name == "lossless"
        if chained:
            assert np.array_equal(loaded.chain.state_dict()["ef.error"], sd["w/worker/ef.error"])


def test_a_ctrl_c_kept_by_a_callback_is_raised_again_by_the_wait():
    """A Ctrl-C that lands in a callback torch runs on the caller's thread (``then`` on a future
    already done) is kept as a RuntimeError's text; interruptible_wait raises it as Ctrl-C
    again (a suite run printed that RuntimeError's traceback from DiLoCo's finish_sync), and
    any other error as it was."""
    from bps_gc.torch.exchange import interruptible_wait

    def interrupted(_):
        raise KeyboardInterrupt

    def failed(_):
        raise ValueError("the pipeline's error")

    for callback, kind in ((interrupted, KeyboardInterrupt), (failed, RuntimeError)):
        done = torch.futures.Future()
        done.set_result(1)
        with pytest.raises(kind) as caught:
            interruptible_wait(done.then(callback))
        assert kind is KeyboardInterrupt or "the pipeline's error" in str(caught.value)
