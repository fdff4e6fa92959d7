"""The numpy recomputation of register_fsdp_hooks' steps on the tests' MLP (16-32-32-8, each
parameter sharded on dim 0): a hook call's average over the replicas of a shard (and
check_hook_calls, which holds a run's calls to it), and the in-host step's reduce-scatters
(shard_compression_params) over a shard group, on torch.distributed (test_fsdp.py) and on the
parameter server (test_fsdp_ps.py)."""
import numpy as np

from fsdp_cases import IN_HOST_ROUNDED, ITEMSIZE, PHASED, ROUNDED

from bps_gc.compress import build_chain
from bps_gc.compress.params import CompressionParams
from bps_gc.compress.reducers import choose_reducer
from bps_gc.collective.exchange.codecs import name_key

# the job's model: its parameters in order, each sharded on dim 0 (2 ranks: even sizes)
PARAMS = [("0.weight", (32, 16)), ("0.bias", (32,)), ("2.weight", (32, 32)), ("2.bias", (32,)),
          ("4.weight", (8, 32)), ("4.bias", (8,))]
LAYERS = {1: PARAMS[0:2], 2: PARAMS[2:4], 3: PARAMS[4:6]}  # FSDP module index -> its parameters
TOPK = {"compressor": "topk", "k": 0.25, "ef": "vanilla"}
CHAINS = {}  # (run, fqn, suffix, senders) -> (the senders' worker chains, the server chain)


def expected_call(ins, shard, params_of_layer, step, run="", shards=2, suffix=None, ranks=None, sent=None, seeds=None,
                  params=TOPK, reducer=None, exact=None):
    """The average over two replicas' reduce-scatter outputs ``ins`` of one FSDP module (float32,
    bfloat16 and float16 ones widened: in float32; float64 in float64): each parameter's padded
    shard (its rows split in ``shards``, rounded up) through its worker chains of ``params``
    (seeded by ``<fqn>#shard<i>``), decoded and summed in replica order, re-compressed by the
    server's chain (the codec's default reducer "recompress"; "lossless": the sum as it is),
    halved (sign's "majority": the vote, +-1, not halved); ``run``: the model's, whose chains are its own. The in-host step: ``ins`` the
    senders' chunks ``shard``, ``suffix`` ``#to_shard<shard>``, ``ranks`` the senders'
    (``seeds``: the ranks their chains are seeded with, if not those), ``reducer`` its reducer
    ("lossless" where the codec's own re-compresses: the exact sum); ``exact``: the position in
    ``ins`` of the sender that reduces the chunk, whose values join that exact sum first, as
    they are (no chain, no payload), the others' decoded payloads after them in turn; ``sent``
    (a list) gets the payloads' bytes, 0 for that sender's. The phased codecs (thc, PowerSGD):
    expected_phased_call."""
    result, offset, dtype = np.empty_like(ins[0]), 0, ins[0].dtype.type
    suffix, ranks = suffix or f"#shard{shard}", ranks or (shard, shards + shard)
    reducer = reducer or choose_reducer(CompressionParams.from_dict(params))
    for fqn, shape in params_of_layer:
        n = -(-shape[0] // shards) * int(np.prod(shape[1:]))
        key = name_key(f"{fqn}{suffix}")
        chains = CHAINS.setdefault((run, fqn, suffix, ranks),
                                   ([build_chain(params, n, dtype, key=key, rank=r) for r in seeds or ranks],
                                    build_chain(params, n, dtype, key=key, role="server")))
        ctx = {"lr": 0.0, "step": step}
        acc = np.zeros(n, dtype) if exact is None else ins[exact][offset:offset + n].copy()
        for k, (chain, x) in enumerate(zip(chains[0], ins)):
            if k == exact:
                if sent is not None:
                    sent.append(0)
                continue
            payload = chain.compress(x[offset:offset + n], ctx)
            if sent is not None:
                sent.append(payload.nbytes)
            acc += chain.decompress(payload)
        if reducer == "majority":  # sign's vote: the decoded +-1 (0 abstains) summed, +1 on a tie, not averaged
            result[offset:offset + n] = np.where(acc < 0, dtype(-1), dtype(1))
            offset += n
            continue
        if reducer == "recompress":
            acc = chains[1].decompress(chains[1].compress(acc, ctx))
        result[offset:offset + n] = acc / dtype(len(ranks))
        offset += n
    assert offset == len(result)
    return result


def expected_phased_call(ins, shard, params_of_layer, step, run, params, shards=2, suffix=None, ranks=None):
    """expected_call for thc and PowerSGD (collective/exchange/phased.py): the inputs in float32
    (a float64 one rounded to it), each parameter's padded shard through its replicas' chains
    (PowerSGD's viewing it in the shard's shape; thc's lanes sized for 2 summands in int64
    words), their first phase's payloads summed, then their second's, each replica's finish
    (the sum; the same on both), halved in float32 and widened to the inputs' dtype. The
    in-host step: ``suffix`` ``#to_shard<shard>``, ``ranks`` the senders' (their chains' seeds)."""
    result, offset = np.empty(len(ins[0]), np.float32), 0
    suffix, ranks = suffix or f"#shard{shard}", ranks or (shard, shards + shard)
    for fqn, shape in params_of_layer:
        rows = -(-shape[0] // shards)
        n = rows * int(np.prod(shape[1:]))
        chains = CHAINS.get((run, fqn, suffix, ranks))
        if chains is None:
            chains = CHAINS[(run, fqn, suffix, ranks)] = [
                build_chain(params, n, np.float32, key=name_key(f"{fqn}{suffix}"), rank=r,
                            shape=(rows,) + tuple(shape[1:])) for r in ranks]
            for chain in chains:
                if hasattr(chain, "set_summands"):
                    chain.set_summands(len(ranks), np.int64)
        words = np.dtype(getattr(chains[0], "phase_dtype", np.float32))
        ctx = {"lr": 0.0, "step": step}
        first = sum(c.compress(x[offset:offset + n].astype(np.float32), ctx).view(words) for c, x in zip(chains, ins))
        second = sum(c.compress_q(first).view(words) for c in chains)
        outs = [c.finish(second, np.empty(n, np.float32), len(ranks)) for c in chains]
        assert all(np.array_equal(out, outs[0], equal_nan=True) for out in outs)
        result[offset:offset + n] = outs[0] / np.float32(len(ranks))
        offset += n
    assert offset == len(result)
    return result.astype(ins[0].dtype)


def check_hook_calls(got, prefix, policy, steps, expected, shards=2):
    """Every hook call of the model ``prefix`` (``steps`` steps) on both replicas of each shard
    (a (2, ``shards``) mesh) equals ``expected(ins, shard, its module's parameters, step)``,
    the float32 average rounded into ``policy``'s half reduce dtype; replicas end
    bit-identical, shards differ."""
    calls, made = got[0][f"{prefix}calls"], {}
    assert len(calls) == steps * len(LAYERS)
    for i, module in enumerate(calls):
        step = made.get(int(module), 0)
        made[int(module)] = step + 1
        for shard in range(shards):
            replicas = (shard, shards + shard)  # mesh (replicate, shard): rank = shards * replica + shard
            want = expected([got[r][f"{prefix}call{i}/in"] for r in replicas], shard, LAYERS[int(module)], step)
            want = ROUNDED.get(policy, lambda x: x)(want)  # reduced in float32, rounded into the reduce dtype
            for r in replicas:
                np.testing.assert_array_equal(got[r][f"{prefix}call{i}/out"], want,
                                              err_msg=f"{prefix}call {i} rank {r}")
    for name, _ in PARAMS:
        for shard in range(shards):
            mates = [got[r][f"{prefix}local/{name}"].tobytes() for r in (shard, shards + shard)]
            assert mates[0] == mates[1], f"{prefix}{name}"
        assert not np.array_equal(got[0][f"{prefix}local/{name}"], got[1][f"{prefix}local/{name}"])  # shards differ


def codec_call(params, run, shards=2):
    """``expected(ins, shard, its module's parameters, step)`` of a hook call with ``params`` on a
    (2, ``shards``) mesh, its chains ``run``'s own: expected_phased_call for the phased codecs,
    else expected_call (check_hook_calls' ``expected``)."""
    if params.get("compressor") in PHASED:
        return lambda ins, shard, layer, step: expected_phased_call(ins, shard, layer, step, run, params, shards=shards)
    return lambda ins, shard, layer, step: expected_call(ins, shard, layer, step, run, shards=shards, params=params)


def check_in_host_reduce_scatters(got, shards, run, steps=3, seed_rank=None, rounded=None, params=TOPK):
    """Every in-host reduce-scatter output of ``got`` (each rank's arrays, a (2, ``shards``)
    mesh: 2 replicas or hosts, rank = shards * replica + shard) against the numpy
    re-computation over its shard group, ``steps`` steps; replicas end bit-identical, shards
    differ. ``seed_rank``: the rank a sender's chains are seeded with, of its rank (default:
    itself; on the parameter server, its rank in the host's group); ``rounded``: the float32
    average rounded into a bfloat16 reduce dtype, as float32 (the inputs: its values, widened);
    ``params``: the codec (thc and PowerSGD through expected_phased_call: no payloads listed).
    {replica: [(destination shard, sending shard, a payload's bytes)] of every call}."""
    phased = params.get("compressor") in PHASED
    # a rank's reduced chunk is sent nowhere after: a sum the codec's server would re-compress is
    # exact here, and the rank's own values join it as they are
    reducer = "lossless" if choose_reducer(CompressionParams.from_dict(params)) in ("recompress", "lossless") else None
    calls = got[0]["rs_calls"]
    assert len(calls) == steps * len(LAYERS)  # the synced micro-batch only
    made, sent = {}, {0: [], 1: []}
    for i, module in enumerate(calls):
        step = made.get(int(module), 0)
        made[int(module)] = step + 1
        for replica in (0, 1):
            senders = tuple(range(shards * replica, shards * (replica + 1)))  # rank = shards * replica + shard
            for shard in range(shards):
                ins, payloads = [got[r][f"rs{i}/in"].reshape(shards, -1)[shard] for r in senders], []
                seeds = None if seed_rank is None else [seed_rank(r) for r in senders]
                if phased:
                    want = expected_phased_call(ins, shard, LAYERS[int(module)], step, run, params, shards=shards,
                                                suffix=f"#to_shard{shard}", ranks=tuple(seeds or senders))
                else:
                    want = expected_call(ins, shard, LAYERS[int(module)], step, run, shards=shards,
                                         suffix=f"#to_shard{shard}", ranks=senders, sent=payloads, seeds=seeds,
                                         params=params, reducer=reducer, exact=shard if reducer else None)
                sent[replica] += [(shard, k % shards, n) for k, n in enumerate(payloads)]  # senders in turn
                want = want if rounded is None else rounded(want)
                np.testing.assert_array_equal(got[senders[shard]][f"rs{i}/out"], want, err_msg=f"rs {i} shard {shard}")
    for name, _ in PARAMS:
        for shard in range(shards):
            assert got[shard][f"local/{name}"].tobytes() == got[shards + shard][f"local/{name}"].tobytes(), name
        assert not np.array_equal(got[0][f"local/{name}"], got[1][f"local/{name}"])
    return sent


def check_in_host_bytes(got, sent, shards, steps, prefix="", itemsize=4, sized=True):
    """Each rank's in_host_* bytes of bps.metrics() (``got[r][prefix + "in_host_..."]``, a (2,
    ``shards``) mesh, ``steps`` steps) as check_in_host_reduce_scatters' payloads (``sent``), each
    chunk's sent to its own shard alone (an all_to_all): pushed, its payloads of the others'
    chunks; pulled, the others' payloads of its own chunk; raw, its inputs (a chunk per shard of
    the padded shards, ``itemsize`` bytes an element: the reduce dtype's). With ``sized`` (a
    codec whose payload's size is its input's alone, not dithering's, whose size follows the
    values) a rank pulls what it pushes: S - 1 payloads of a chunk's size, where an all_gather of
    the whole compressed inputs moves S times as many each way."""
    padded = sum(-(-shape[0] // shards) * int(np.prod(shape[1:])) for _, shape in PARAMS)
    for r, arrays in enumerate(got):
        own, payloads = r % shards, sent[r // shards]
        pushed = sum(n for to, by, n in payloads if by == own and to != own)
        pulled = sum(n for to, by, n in payloads if by != own and to == own)
        counted = [int(arrays[f"{prefix}in_host_{kind}"]) for kind in ("pushed_wire", "pulled_wire", "pushed_raw")]
        assert counted == [pushed, pulled, steps * shards * itemsize * padded], (r, counted, pushed, pulled)
        assert not sized or (pushed == pulled and pushed > 0), (r, pushed, pulled)


def check_in_host_policies(got, name, policies, params, steps, count=True, sized=True):
    """Each policy's in-host reduce-scatters of ``got`` (its prefix dropped; None: the plain model)
    against numpy, and, if ``count``, metrics()' in-host bytes; [(policy, its run)]."""
    runs = []
    for policy in policies:
        prefix = "" if policy is None else f"{policy}/"
        run = [{k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)} for arrays in got]
        sent = check_in_host_reduce_scatters(run, 2, f"{name}/{prefix}", steps=steps, params=params,
                                             rounded=IN_HOST_ROUNDED.get(policy))
        if count:
            check_in_host_bytes(run, sent, 2, steps, "bytes/", itemsize=ITEMSIZE.get(policy, 4), sized=sized)
        runs.append((policy, run))
    return runs
