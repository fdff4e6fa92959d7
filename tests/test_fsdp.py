"""bps_gc.torch.register_fsdp_hooks: FSDP2 sharded on mesh["shard"], its replicate dimension
averaged by bps_gc's exchange, on a (2, 2) gloo mesh under torchrun (and a (2, 3) one). Dense, it trains as native
HSDP does; with a codec, every hook call equals the numpy re-computation over the two replicas
that hold the shard (each shard's chains seeded by its name ``<fqn>#shard<i>``), and those
replicas end with bit-identical shards. Models it cannot serve are refused in one line."""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from collective_cluster import run_torchrun_job
from fsdp_bytes import CODECS, EF, THC, table
from fsdp_cases import (CODEC_POLICIES, DENSE_STEPS, DTYPE_CODECS, IN_HOST_CODECS, ITEMSIZE, PHASED, POLICIES,
                        REFUSED, WIDE, check_reduce_dtypes)
from fsdp_diloco_oracle import diloco_reference
import lm_hsdp_case
from fsdp_inhost_oracle import (LAYERS, PARAMS, TOPK, check_hook_calls, check_in_host_bytes, check_in_host_policies,
                                check_in_host_reduce_scatters, codec_call, expected_call)

from bps_gc.compress.stateful import StateError
from bps_gc.torch import register_fsdp_hooks
from bps_gc.torch.fsdp import ShardLayout

# after fsdp_bytes: multihost.py (under these) puts scripts/, which has a namesake, first on the path
from collective_hosts import TESTS, CollectiveHostsJob  # noqa: E402
from local_ranks import machines_or_loopback  # noqa: E402,F401 (a fixture)

EF_DEVICE = ("onebit+EF", "topk 1%+EF")  # trained on device chains too (test_bytes_per_step_and_codec_memory)


def run(spec, tmp_path, ranks=4):
    """Each rank's arrays (torchrun: under bpslaunch --servers 0 the ranks ended later, docs/fsdp.md)."""
    run_torchrun_job("fsdp_job.py", spec, tmp_path, ranks)
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(ranks)]


# resume_runs' models (SGD with momentum, 6 steps, saved after step 3): top-k + EF, thc 4-bit + EF, top-k
# + EF in the host only ("inhost": dense across replicas), top-k + EF from step 4 (after the resume)
RESUME = {"mode": "resume", "steps": 6, "stop_at": 3, "in_host": {"inhost": TOPK}, "dense_steps": {"dense_first": 4},
          "diloco": {"diloco": TOPK},  # DiLoCo over the shards, H = 2: saved mid-window (step 3)
          "runs": {"topk": TOPK, "thc": THC, "inhost": None, "dense_first": TOPK}}


@pytest.fixture(scope="module")
def parts_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp_parts")


@pytest.fixture(scope="module")
def launch(parts_dir):
    """One launch of several parts, each seeded and fed as a launch of its own: the first phase
    of resume_runs (its own arrays); native HSDP and the dense hooks, DENSE_STEPS; the other codecs
    under the policies (DTYPE_CODECS); the in-host step; dense steps first; the hooks with top-k
    + EF, two micro-batches a step, 3 steps (the MLP and one model per policy, then the wider
    model once per fsdp_bytes.CODECS codec). Each rank's saved arrays. The parts run in this
    order, top-k last: from its first bytes model on, tracemalloc traces every allocation
    (fsdp_bytes.py), which slowed the parts after it."""
    return run({"mode": "parts", "parts": {
        "resume": {**RESUME, "phase": "first"},
        "native": {"mode": "native", "steps": DENSE_STEPS, "policies": POLICIES},
        "hooked": {"mode": "hooked", "steps": DENSE_STEPS, "policies": POLICIES},
        # the LM's GPT (lm_hsdp_case.py, 10 steps), sharded as the yardstick shards it
        "lm_native": {"mode": "lm", "how": "native"}, "lm_hooked": {"mode": "lm", "how": "hooks"},
        **{f"dtype_{codec}": {"mode": "hooked", "steps": 2, "compression_params": params, "policies": policies,
                              "plain": False} for codec, (params, policies) in DTYPE_CODECS.items()},
        # the in-host reduce-scatter through the exchange: without a codec, then top-k + EF
        "inhost_dense": {"mode": "hooked", "steps": DENSE_STEPS, "shard_compression_params": {}},
        "inhost_topk": {"mode": "hooked", "steps": 3, "shard_compression_params": TOPK, "micro_batches": 2,
                        "policies": CODEC_POLICIES},
        **{f"inhost_{codec}": {"mode": "hooked", "steps": 2, "shard_compression_params": params,
                               "plain": None in policies, "policies": [p for p in policies if p]}
           for codec, (params, policies) in IN_HOST_CODECS.items()},
        # DiLoCo across the replicas over the model sharded in each (no hooks), H = 2, 6 steps
        "diloco_dense": {"mode": "diloco", "steps": 6, "sync_every": 2, "refusals": True},
        "diloco_topk": {"mode": "diloco", "steps": 6, "sync_every": 2, "compression_params": TOPK},
        "dense_first": {"mode": "hooked", "steps": 3, "compression_params": TOPK, "dense_steps": 1,
                        "record_rs": True},  # metrics()' bytes saved
        "topk": {"mode": "hooked", "steps": 3, "compression_params": TOPK, "micro_batches": 2,
                 "policies": CODEC_POLICIES, "bytes": CODECS,
                 "bytes_device": {name: CODECS[name] for name in EF_DEVICE}}}},
        parts_dir)


def part(launch, name):
    """Each rank's arrays of one part, its prefix dropped."""
    return [{k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(f"{name}/")} for arrays in launch]


def test_dense_hooks_train_as_native_hsdp(launch):
    native, hooked = part(launch, "native"), part(launch, "hooked")
    two_d, mismatched, float64, in_host64 = (str(r) for r in launch[0]["refusals"][:4])
    assert "sharded on a 2-D mesh (2, 2)" in two_d and "shard it on mesh['shard']" in two_d, two_d
    assert mismatched == ("register_fsdp_hooks: the replicate group (ranks [0, 1]) does not match the mesh: rank 0 "
                          "shards with ranks [0, 1]; pass mesh['replicate'] of the mesh whose mesh['shard'] the "
                          "model is sharded on"), mismatched
    assert float64.startswith("register_fsdp_hooks: compressor 'terngrad' cannot take the reduce dtype torch.float64 "
                              "of '0.weight#shard0' (TernGrad: float32 or float16 partitions only, got float64); set "
                              "fully_shard's mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)"), float64
    assert "\n" not in float64
    assert in_host64.startswith("register_fsdp_hooks: shard_compression_params' compressor 'terngrad' cannot take "
                                "the reduce dtype torch.float64 of '0.weight#shard0'"), in_host64
    assert "\n" not in in_host64
    for prefix in [""] + [f"{policy}/" for policy in POLICIES]:  # the plain model, then one per policy
        for name, _ in PARAMS:
            want = native[0][f"{prefix}full/{name}"]
            for r in range(4):
                np.testing.assert_allclose(hooked[r][f"{prefix}full/{name}"], want, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{prefix}{name}")
    # bf16 compute trained otherwise than float32, and a bfloat16 reduction otherwise than a float32 one
    assert not np.array_equal(native[0]["bf16/full/0.weight"], native[0]["full/0.weight"])
    assert not np.array_equal(native[0]["bf16r/full/0.weight"], native[0]["bf16/full/0.weight"])
    # the LM (issue 42's target): 10 steps of its GPT through the dense hooks as native HSDP, every
    # parameter within 1e-6 relative on every rank; and trained (away from its initial values)
    lm_native, lm_hooked = part(launch, "lm_native"), part(launch, "lm_hooked")
    names, initial = [k for k in lm_native[0] if k.startswith("full/")], dict(lm_hsdp_case.model().named_parameters())
    assert len(names) == len(initial)
    for name in names:
        for r in range(4):
            np.testing.assert_allclose(lm_hooked[r][name], lm_native[0][name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert not np.allclose(lm_native[0]["full/tokens.weight"], initial["tokens.weight"].detach().numpy(), atol=1e-4)


@pytest.fixture(scope="module")
def topk_run(launch):
    return part(launch, "topk")


def test_topk_hooks_equal_numpy_and_replicas_agree(topk_run):
    """Two micro-batches a step, the first under set_requires_gradient_sync(False): the hooks run
    (and the codecs' state moves) on the synced one only, once per module and step. Under a
    bfloat16 or float16 reduce dtype the codec gets the widened inputs and the float32 average is
    rounded into it; float64 parameters are compressed and averaged in float64."""
    got = topk_run
    for policy in [None] + CODEC_POLICIES:  # the plain model, then one per policy
        prefix = "" if policy is None else f"{policy}/"
        check_hook_calls(got, prefix, policy, 3, lambda ins, shard, layer, step: expected_call(
            ins, shard, layer, step, prefix))
    check_reduce_dtypes(got, "call0/in", "call0/out")


def test_other_codecs_under_the_reduce_dtypes_equal_numpy_or_are_refused(launch):
    """DTYPE_CODECS under float16 and bfloat16 reduce dtypes, bf16 parameters reduced in
    float32, float64 parameters, CPU offload: every hook call (2 steps) equals the numpy re-computation, the
    codec fed the widened float32 (float64 kept by the element-wise codecs; thc's and
    PowerSGD's phases in float32, their average widened back) and the average rounded into a
    half reduce dtype; replicas end bit-identical. QSGD and DGC cannot take float64: each
    refused by register_fsdp_hooks in one line, on every rank, before any step."""
    for codec, (params, policies) in DTYPE_CODECS.items():
        got = part(launch, f"dtype_{codec}")
        for policy in policies:
            prefix = f"{policy}/"
            if (codec, policy) in REFUSED:
                for r in range(4):
                    message = str(got[r][f"{prefix}refused"])
                    assert message.startswith(f"register_fsdp_hooks: compressor {params['compressor']!r} cannot take "
                                              f"the reduce dtype torch.float64 of '0.weight#shard{r % 2}' "
                                              f"({REFUSED[codec, policy]}); set fully_shard's mp_policy="), message
                    assert "\n" not in message and f"{prefix}calls" not in got[r], message
                continue
            check_hook_calls(got, prefix, policy, 2, codec_call(params, f"dtype_{codec}/{prefix}"))


def test_dense_steps_average_dense_then_through_the_codec(launch):
    """register_fsdp_hooks(..., dense_steps=1): each module's first call is the replicas' plain
    mean (an all_reduce, as native HSDP's), its later ones the codec's, whose chains start then
    (their step 0)."""
    got = part(launch, "dense_first")
    calls, steps, pushed = got[0]["calls"], {}, [0] * 4
    assert len(calls) == 3 * len(LAYERS)
    for i, module in enumerate(calls):
        step = steps.get(int(module), 0)
        steps[int(module)] = step + 1
        for shard in (0, 1):
            ranks, sent = (shard, 2 + shard), []
            ins = [got[r][f"call{i}/in"] for r in ranks]
            want = (ins[0] + ins[1]) / np.float32(2) if step == 0 else \
                expected_call(ins, shard, LAYERS[int(module)], step - 1, "dense_first", sent=sent)
            for j, r in enumerate(ranks):  # a dense step pushes the shard, a codec's its payloads
                pushed[r] += ins[j].nbytes if step == 0 else sum(sent[j::2])
                np.testing.assert_array_equal(got[r][f"call{i}/out"], want, err_msg=f"call {i} rank {r}")
    assert [int(got[r]["bytes/pushed_wire"]) for r in range(4)] == pushed  # metrics() counts the dense steps


def test_in_host_step_dense_equals_native_and_topk_equals_numpy(launch):
    """register_fsdp_hooks(..., shard_compression_params=): without a codec the model trains as
    native HSDP; with top-k + EF (dense across replicas) every reduce-scatter's output is the
    numpy re-computation over its shard group (each destination chunk's pieces through their
    chains, seeded by ``<fqn>#to_shard<d>``, the senders' in rank order), replicas end
    bit-identical, and metrics() counts the in-host bytes apart: the pieces' payloads, each
    chunk's sent to its own shard alone (an all_to_all: half an all_gather's bytes at S = 2). The
    same under each of CODEC_POLICIES: a bfloat16 or float16 reduce dtype widened for the codec
    and the average rounded into it (float16: times 2, FSDP2's sum), float64 kept."""
    native, dense, got = part(launch, "native"), part(launch, "inhost_dense"), part(launch, "inhost_topk")
    for name, _ in PARAMS:
        for r in range(4):
            np.testing.assert_allclose(dense[r][f"full/{name}"], native[0][f"full/{name}"], rtol=1e-6, atol=1e-7,
                                       err_msg=f"{name} rank {r}")
    for policy, run in check_in_host_policies(got, "inhost", [None] + CODEC_POLICIES, TOPK, steps=3):
        for r in range(4):  # dense across replicas, in the reduce dtype
            assert run[r]["bytes/pushed_wire"] == 3 * ITEMSIZE.get(policy, 4) * sum(math.prod(s) for _, s in PARAMS) // 2
    check_reduce_dtypes(got, "rs0/out", "rs0/out")  # its inputs under bf16: bfloat16 gradients, widened


@pytest.mark.parametrize("codec", IN_HOST_CODECS)
def test_in_host_step_with_other_codecs_equals_numpy(launch, codec):
    """The in-host step with the other codecs (IN_HOST_CODECS, some under reduce dtypes and
    offload), 2 steps: as top-k + EF's above; thc's and PowerSGD's bytes are not the payloads'
    (their phases are all-reduced over the whole input: docs/fsdp_inhost.md)."""
    check_in_host_policies(part(launch, f"inhost_{codec}"), f"inhost_{codec}", IN_HOST_CODECS[codec][1],
                           IN_HOST_CODECS[codec][0], steps=2, count=codec not in PHASED, sized=codec != "dithering")


@pytest.mark.parametrize("run", ["dense", "topk"])
def test_diloco_over_fsdp2_shards_equals_the_recomputation(launch, run):
    """bps_gc.torch.DiLoCo across mesh["replicate"] over the MLP sharded on mesh["shard"]
    (FSDP2 inside each replica, no hooks), H = 2, 6 SGD steps: every rank's full parameters
    after every step equal fsdp_diloco_oracle's one-process recomputation within 1e-6 (dense;
    top-k 25% + EF: each shard's pseudo-gradient through its numpy chains named ``<fqn>#shard<i>``),
    the replicas bit-identical after each sync and apart between; refused in one line: no
    replicate group, mesh["shard"]'s, a model sharded on the 2-D mesh."""
    got, want = part(launch, f"diloco_{run}"), diloco_reference(6, 2, None if run == "dense" else TOPK)
    for step in range(6):
        for r in range(4):
            for name, _ in PARAMS:
                np.testing.assert_allclose(got[r][f"full/{step}/{name}"], want[step][r // 2][name], rtol=1e-6,
                                           atol=1e-7, err_msg=f"{run} step {step} rank {r} {name}")
        same = got[0][f"full/{step}/0.weight"].tobytes() == got[2][f"full/{step}/0.weight"].tobytes()
        assert same == (step % 2 == 1), (run, step)
    if run == "dense":
        refusals = [str(r) for r in launch[0]["refusals"][4:7]]
        assert refusals[0].startswith("DiLoCo: '0.weight' is a DTensor (a model sharded with fully_shard): pass "
                                      "the process group"), refusals[0]
        assert refusals[1].startswith("DiLoCo: the ranks of replicate (ranks [0, 1]) hold different shards"), refusals
        assert refusals[2].startswith("DiLoCo: '0.weight' is sharded on a 2-D mesh: shard the model on "
                                      "mesh['shard'] alone"), refusals[2]
        assert not any("\n" in r for r in refusals)


def test_bytes_per_step_and_codec_memory(topk_run):
    """Issue 42's bytes and memory targets on the wider model (3 steps of 2 micro-batches), every
    rank: the bytes bps_gc.torch.metrics() counts per step equal each codec's wire format over
    the shard shapes (docs/codecs.md), the dense hook's equal native HSDP's (the reduce-scatter
    outputs: one per module and synced micro-batch), and thc 4-bit hands the wire at most 1/5.5
    of native's, onebit+EF at most 1/25; with the codecs with error feedback, what the exchange
    saves, holds and leaves alive between steps is at most twice the rank's parameter shard, on
the numpy chains and (onebit+EF and top-k+EF) on the device chains a CUDA shard runs, here on
CPU tensors (their in-call tensors shared and freed after each call: 6.9x and 4x before)."""
    sizes = [math.prod(shape) // 2 for shape in WIDE]
    matrices = [(shape[0] // 2, shape[1]) if len(shape) == 2 else near_square(n) for shape, n in zip(WIDE, sizes)]
    native = 4 * sum(sizes)  # float32

    def words(n, per_word):
        return -(-n // per_word)
    want = {"dense": native,
            # 8-byte words: phase 1 the 160 histogram counts in 2-bit lanes (32 a word), phase 2
            # 3 header words, then 5-bit lanes (4 bits + 1 for 2 summands, 12 a word)
            "thc 4-bit": sum(8 * (words(160, 32) + 3 + words(n, 12)) for n in sizes),
            "onebit+EF": sum(4 * words(n, 32) + 4 for n in sizes),  # 32-bit words of signs, the scale
            "PowerSGD r4": sum(4 * min(4, rows, cols) * (rows + cols) for rows, cols in matrices)}  # P and Q
    for r, got in enumerate(topk_run):
        for name in CODECS:
            assert got[f"bytes/{name}/native"] == native, (r, name)
            assert got[f"bytes/{name}/shard"] == native, (r, name)  # float32 parameters, even shards
            assert got[f"bytes/{name}/pulled"] == got[f"bytes/{name}/wire"], (r, name)  # 2 replicas
        for name, wire in want.items():
            assert got[f"bytes/{name}/wire"] == wire, (r, name)
        assert 5.5 * got["bytes/thc 4-bit/wire"] <= native and 25 * got["bytes/onebit+EF/wire"] <= native, r
        assert 0 < got["bytes/topk 1%+EF/wire"] < native / 10, r
        assert got["bytes/dense/state"] == 0 and got["bytes/dense/held"] <= 4 * len(sizes), r  # stand-ins' element
        for name in EF + tuple(f"{name} device" for name in EF_DEVICE):
            state, held, alive = (got[f"bytes/{name}/{k}"] for k in ("state", "held", "alive"))
            assert sum(sizes) * 4 <= state <= held, (r, name)  # the residual at least
            # issue 42's memory target, beside the shards' stand-ins (one element each)
            assert max(state, held - 4 * len(sizes), alive) <= 2 * native, (r, name, state, held, alive)
        for name in EF_DEVICE:  # device chains: the same payloads as the numpy chains'
            assert got[f"bytes/{name} device/wire"] == got[f"bytes/{name}/wire"], (r, name)
    print("\n".join(table(topk_run[0])))


@pytest.fixture(scope="module")
def launch_2x3(tmp_path_factory):
    """A (2, 3) mesh, 6 ranks, one launch: native HSDP and the dense hooks, DENSE_STEPS; top-k +
    EF, two micro-batches a step, 3 steps, across replicas and in the host; each other codec
    (DTYPE_CODECS') across replicas, 2 steps. The MLP's rows (32, 32, 8) split in 3 unevenly:
    FSDP2 pads them (11, 11, 10 + 1 row; 3, 3, 2 + 1)."""
    return run({"mode": "parts", "mesh": [2, 3], "parts": {
        "native": {"mode": "native", "steps": DENSE_STEPS},
        "hooked": {"mode": "hooked", "steps": DENSE_STEPS},
        "topk": {"mode": "hooked", "steps": 3, "compression_params": TOPK, "micro_batches": 2},
        "inhost_topk": {"mode": "hooked", "steps": 3, "shard_compression_params": TOPK, "micro_batches": 2},
        **{f"codec_{codec}": {"mode": "hooked", "steps": 2, "compression_params": params}
           for codec, (params, _) in DTYPE_CODECS.items()}}},
        tmp_path_factory.mktemp("fsdp_2x3"), ranks=6)


def test_on_a_2x3_mesh_dense_hooks_train_as_native_and_every_codec_equals_numpy(launch_2x3):
    """Replicas of shard s: ranks s and 3 + s. Dense hooks against native HSDP on every rank;
    every top-k hook call, and every call of each other codec, against the numpy re-computation
    of its (padded) shards; replicas bit-identical, shards differing. The same of the in-host
    step's reduce-scatters, and their bytes (each chunk's payloads to its own shard alone)."""
    native, hooked, got = (part(launch_2x3, name) for name in ("native", "hooked", "topk"))
    for name, _ in PARAMS:
        for r in range(6):
            np.testing.assert_allclose(hooked[r][f"full/{name}"], native[0][f"full/{name}"], rtol=1e-6, atol=1e-7,
                                       err_msg=f"{name} rank {r}")
    check_hook_calls(got, "", None, 3, lambda ins, shard, layer, step: expected_call(
        ins, shard, layer, step, "2x3/", shards=3), shards=3)
    for name, _ in PARAMS:
        assert got[0][f"local/{name}"].shape[0] == -(-dict(PARAMS)[name][0] // 3)
    for codec, (params, _) in DTYPE_CODECS.items():  # each codec's chains its own
        check_hook_calls(part(launch_2x3, f"codec_{codec}"), "", None, 2, codec_call(params, f"2x3 {codec}/", 3),
                         shards=3)
    # the in-host step (top-k + EF) on 3 shards: padded chunks, 3 senders each sending its peers their chunks alone
    in_host = part(launch_2x3, "inhost_topk")
    check_in_host_bytes(in_host, check_in_host_reduce_scatters(in_host, 3, "2x3 inhost/"), 3, 3, "bytes/")


def near_square(n):
    """PowerSGD's matrix of a 1-D shard (docs/codecs.md): ceil(sqrt(n)) columns."""
    return -(-n // (math.isqrt(n - 1) + 1)), math.isqrt(n - 1) + 1


@pytest.fixture(scope="module")
def resume_runs(launch, parts_dir, machines_or_loopback):
    """Two launches of RESUME's four models: the first (launch's first part) saves after step 3
    (the models and optimizers with torch.distributed.checkpoint, the hooks' codec state with
    bps_gc.torch.state_dict()) and trains on; the second loads them into fresh processes and
    trains the rest, then trains straight runs, with each replica's 2 ranks on a host of its own
    (a network namespace, one torchrun per host; on loopback where there are none), so that its
    runs, compared with the first launch's on one host, show the hosts differing changes no bit.
    Each rank's saved arrays, per launch."""
    spec = {**RESUME, "phase": "resumed"}
    if machines_or_loopback is None:
        run_torchrun_job("fsdp_job.py", spec, parts_dir, 4)
    else:
        (parts_dir / "spec.json").write_text(json.dumps(spec))
        job = CollectiveHostsJob(machines_or_loopback, 2, 2, [sys.executable, os.path.join(TESTS, "fsdp_job.py"),
                                                              str(parts_dir / "spec.json"), str(parts_dir)], "torchrun")
        statuses, _ = job.wait_all(300)
        assert set(statuses.values()) == {0}, job.report(statuses)
    return {phase: [dict(np.load(parts_dir / f"{phase}{r}.npz")) for r in range(4)] for phase in ("first", "resumed")}


def test_resumed_hooks_continue_as_the_straight_run_bit_for_bit(resume_runs):
    """Every shard's error-feedback residual, reducer state and step count come back: without
    them (the codecs afresh) the resumed run differs from the straight one."""
    for r, got in enumerate(resume_runs["resumed"]):
        for run in ("topk", "thc", "inhost", "dense_first", "diloco"):
            for name, _ in PARAMS:
                for kind in ("full", "local"):
                    assert got[f"{run}/resumed/{kind}/{name}"].tobytes() == \
                        got[f"{run}/straight/{kind}/{name}"].tobytes(), f"rank {r} {run} {kind} {name}"
    got = resume_runs["resumed"][0]  # the codecs trained otherwise, and so did the dense start
    assert not np.array_equal(got["topk/straight/full/0.weight"], got["thc/straight/full/0.weight"])
    assert not np.array_equal(got["topk/straight/full/0.weight"], got["dense_first/straight/full/0.weight"])


def test_two_launches_of_the_same_job_end_bit_identical(resume_runs):
    """The first launch (a checkpoint saved midway) and the second's straight run: runs repeat,
    and with its hosts apart (resume_runs) the second ends on the first's bits too."""
    for r in range(4):
        first, straight = resume_runs["first"][r], resume_runs["resumed"][r]
        for run in ("topk", "thc", "inhost", "diloco"):
            for name, _ in PARAMS:
                assert first[f"{run}/first/full/{name}"].tobytes() == \
                    straight[f"{run}/straight/full/{name}"].tobytes(), f"rank {r} {run} {name}"
    torch.manual_seed(0)  # the job's first layer as built: the runs trained it
    assert not np.array_equal(resume_runs["first"][0]["thc/first/full/0.weight"],
                              torch.nn.Linear(16, 32).weight.detach().numpy())


def test_distributed_optimizer_and_ddp_hook_refuse_dtensor_parameters(resume_runs):
    """DDP cannot take a sharded model (it fails broadcasting a DTensor; with init_sync=False
    it never calls its hook), so the DDP hook refuses where it is made, from named_parameters
    or the optimizer's parameters."""
    optimizer, named, by_optimizer = (str(r) for r in resume_runs["resumed"][0]["refusals"])
    assert optimizer.startswith("DistributedOptimizer: '0.weight' is a DTensor"), optimizer
    assert "register_fsdp_hooks" in optimizer, optimizer
    assert named == ("comm_hook: '0.weight' is a DTensor (a model sharded with fully_shard): compress its gradients "
                     "with bps_gc.torch.register_fsdp_hooks(model, mesh['replicate'], compression_params) instead of "
                     "DDP"), named
    assert by_optimizer.startswith("comm_hook: 'param.0' is a DTensor"), by_optimizer


def test_codec_state_of_another_mesh_is_refused_naming_both():
    saved = ShardLayout(2, 2, 1).codec_state().state_dict()  # what bps_gc.torch.state_dict() holds of it
    ShardLayout(2, 2, 1).codec_state_to_load(saved)
    with pytest.raises(StateError, match=r"saved on the mesh \(replicas, shards\) \(2, 2\) as shard 1, and this "
                                         r"rank is shard 1 of \(1, 4\)"):
        ShardLayout(1, 4, 1).codec_state_to_load(saved)


def test_a_model_without_fsdp_modules_is_refused():
    with pytest.raises(ValueError, match="has no FSDPModule"):
        register_fsdp_hooks(torch.nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match=r"dense_steps must be a whole number >= 0, got -1$"):
        register_fsdp_hooks(torch.nn.Linear(2, 2), None, dense_steps=-1)
    with pytest.raises(ValueError, match="dense_steps needs a replicate group"):
        register_fsdp_hooks(torch.nn.Linear(2, 2), None, dense_steps=2)
