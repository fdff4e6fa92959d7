"""On torch.distributed (gloo, loopback) every codec gives what the parameter server gives:
the numpy re-computation of tests/reference.py (worker chains, rank-ordered decode-and-sum, the
server chain's recompression), bit for bit for compressed tensors. Dense sums are all_reduce:
gloo's ring adds in its own order, so with more than two ranks they match to float rounding.

The tests' tensor sets (names prefixed by the set) run in one launch for both rank counts (a
module fixture; bpslaunch --servers 0, without torchrun's agent: 4 processes, the 4 ranks' job
and then the 2 ranks' on the first two, each in a gloo group of its own), each test checking
its own set."""
import json
import os
import subprocess

import numpy as np
import pytest

from collective_cluster import TESTS, bpslaunch_argv, job_env
from conftest import ROOT
from reference import PushPullModel, expected_results
from test_cluster_exact import CODECS, SHAPES


def spec_all_codecs(dtype, codecs=CODECS, efs=(False, True)):
    tensors = []
    for codec, params in codecs.items():
        for ef in efs if params else (False,):
            for label, shape in SHAPES.items():
                p = dict(params, ef="vanilla") if ef else dict(params)
                tensors.append({"name": f"{codec}-{'ef' if ef else 'plain'}-{label}", "shape": shape,
                                "dtype": dtype, "params": p})
    tensors.append({"name": "sum", "shape": [33], "dtype": dtype, "average": False, "params": {}})
    return tensors


def fp16_tensors():
    codecs = {c: CODECS[c] for c in ("dense", "onebit", "topk", "randomk", "dithering")}
    return spec_all_codecs("float16", codecs=codecs) + [
        {"name": "fp16-wire", "shape": [5000], "dtype": "float32",
         "params": {"compressor": "topk", "k": 50, "fp16": True}},
        {"name": "fp16-dense", "shape": [77], "dtype": "float32", "params": {"fp16": True}},
        {"name": "nesterov", "shape": [4000], "dtype": "float32",
         "params": {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}},
    ]


def reducer_tensors():
    """recompress, lossless and majority (a sign all_reduce here) as the parameter server runs
    them (test_cluster_reducers.py), plus a codec whose output depends on the step context."""
    from test_cluster_reducers import CASES
    tensors = [{"name": f"{case}-{label}", "shape": shape, "dtype": "float32", "params": dict(params),
                "reducer": reducer}
               for case, (params, reducer) in CASES.items() for label, shape in SHAPES.items()]
    return tensors + [{"name": "step-mask", "shape": [37, 3], "dtype": "float32",
                       "params": {"compressor": "test_step_mask"}}]


def alone_tensors():
    """Dense arrays large enough to be all_reduced alone (collective/buckets.py's ALONE_BYTES)
    when every rank reduces them in place at first: in place on every step; into another array
    on every step (fused), from the second step on (alone, copied into it) and on odd ranks only
    (fused: the ranks agree); the job checks an input reduced into another array is left alone.
    Averaged and summed; one whose fp16 wire is not its dtype; a small one between, fused."""
    shape, tensors = [1_050_001], []  # 4.2 MB of float32
    for average in (True, False):
        for out in (False, True, "later", "odd ranks"):
            tensors.append({"name": f"{'avg' if average else 'sum'}-{out}", "shape": shape,
                            "dtype": "float32", "average": average, "out": out, "params": {}})
    return tensors + [{"name": "small", "shape": [1000], "dtype": "float32", "params": {}},
                      {"name": "fp16-wire", "shape": [2_100_001], "dtype": "float32", "params": {"fp16": True}}]


def view_tensors():
    """Dense arrays laid out back to back in one flat array, in push order (cluster_job.py's
    ``view``), reduced in place: "a" (float32, averaged, one of them large enough to go alone
    were it not a view) on every rank, "b" (float64, averaged and summed) on odd ranks only,
    separate arrays on the others (the same all_reduce). Each flat array is what gloo reduces."""
    return [{"name": "a-small", "shape": [10, 100], "dtype": "float32", "view": "a", "params": {}},
            {"name": "a-large", "shape": [1_050_001], "dtype": "float32", "view": "a", "params": {}},
            {"name": "a-last", "shape": [77], "dtype": "float32", "view": "a", "params": {}},
            {"name": "b-avg", "shape": [500], "dtype": "float64", "view": "b", "view_ranks": "odd", "params": {}},
            {"name": "b-sum", "shape": [3, 100], "dtype": "float64", "view": "b", "view_ranks": "odd",
             "average": False, "params": {}}]


RANKS = (4, 2)  # the launch's jobs, largest first (tests/cluster_jobs.py)
SETS = {"float32": lambda: spec_all_codecs("float32"), "float16": fp16_tensors, "reducers": reducer_tensors,
        "alone": alone_tensors, "views": view_tensors}


def spec_of_every_set():
    """Every set's tensors, named ``<set>:<name>``, pushed set after set (each set's steps as
    its own launch had them); the step context carries ``gain`` for the plugin codec
    (test_step_mask), which the other codecs ignore."""
    tensors = [dict(t, name=f"{name}:{t['name']}", set=name) for name, make in SETS.items() for t in make()]
    return {"steps": 3, "lrs": [0.1, 0.05, 0.05], "ctx": {"gain": 0.5}, "partition_bytes": 131_072,
            "min_compress_bytes": 0, "tensors": tensors, "held": True}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """ranks -> (spec, each rank's results, the numpy oracle's, each rank's views in place): one
    launch of 4 processes (bpslaunch --servers 0) for both rank counts, 4 ranks then 2
    (tests/cluster_jobs.py: each its own gloo group, its processes started once)."""
    import plugin_step_codec  # noqa: F401  (the model needs test_step_mask registered too)
    spec, folders = spec_of_every_set(), {ranks: tmp_path_factory.mktemp(f"ranks{ranks}") for ranks in RANKS}
    for out in folders.values():
        (out / "spec.json").write_text(json.dumps(spec))
    jobs = tmp_path_factory.mktemp("jobs") / "jobs.json"
    jobs.write_text(json.dumps([{"spec": str(out / "spec.json"), "out": str(out), "workers": ranks}
                                for ranks, out in folders.items()]))
    env = job_env({"BYTEPS_PARTITION_BYTES": str(spec["partition_bytes"]), "BPS_GC_PLUGINS": "plugin_step_codec",
                   "BYTEPS_MIN_COMPRESS_BYTES": str(spec["min_compress_bytes"])})
    result = subprocess.run(bpslaunch_argv([os.path.join(TESTS, "cluster_jobs.py"), str(jobs)], max(RANKS)),
                            env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    runs = {}
    for ranks, out in folders.items():
        results = [dict(np.load(out / f"rank{r}.npz")) for r in range(ranks)]
        views = [json.loads((out / f"metrics{r}.json").read_text())["views:in place"] for r in range(ranks)]
        runs[ranks] = spec, results, expected_results(spec, ranks), views

    def get(ranks):
        return runs[ranks]
    get.out = lambda ranks: folders[ranks]  # the launch's folder (its held<rank>.json)
    return get


def check(launched, ranks, tensor_set):
    """The set's tensors on every rank against the oracle: bit for bit where compressed or on
    2 ranks, else to the wire dtype's rounding."""
    spec, results, all_expected, _ = launched(ranks)
    mine = lambda key: key.startswith(f"{tensor_set}:")  # noqa: E731
    expected = {key: value for key, value in all_expected.items() if mine(key)}
    assert expected
    models = {t["name"]: PushPullModel(t.get("params"), t["shape"], t["dtype"], 0, 1, spec["partition_bytes"],
                                       spec["min_compress_bytes"]) for t in spec["tensors"]}
    for rank, all_got in enumerate(results):
        assert set(all_got) == set(all_expected)
        got = {key: value for key, value in all_got.items() if mine(key)}
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            model = models[key.split("/")[0]]
            if model.compressed or ranks == 2:
                assert got[key].tobytes() == value.tobytes(), \
                    f"rank {rank} {key}: max diff {np.abs(got[key].astype(float) - value).max()}"
            else:
                # a few roundings of the wire dtype apart (sums of ~N(0, 4) values)
                tol = 4e-3 if model.wire == np.float16 else 1e-5
                np.testing.assert_allclose(got[key], value, rtol=tol, atol=tol, err_msg=f"rank {rank} {key}")
    return results


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_codec_and_ef_float32(ranks, launched):
    check(launched, ranks, "float32")


def test_codecs_hold_their_state_and_share_the_rest(launched):
    """After the steps, each float32 tensor's partitions' codecs (the worker chain, and the
    reducer that runs the server's chain on every rank) hold error feedback's residual and the g
    it swaps with, each chain's (4 buffers of the tensor's size), a random codec's generators,
    and nothing else: the sums and decoded payloads come from one scratch of the communicator,
    a few partitions' worth (BYTEPS_PARTITION_BYTES here 131,072), where each partition kept
    its own (2 more of the tensor's size, and this fails)."""
    spec, *_ = launched(2)
    limit = spec["partition_bytes"]
    for rank in range(2):
        got = json.loads((launched.out(2) / f"held{rank}.json").read_text())
        assert 0 < got["scratch"] <= 4 * limit, got["scratch"]
        for t in spec["tensors"]:
            if t["set"] != "float32" or not t["params"]:
                continue
            n = 4 * int(np.prod(t["shape"]))
            partitions = -(-n // limit)
            ef = 4 * n if t["params"].get("ef") else 0
            assert ef <= got["tensors"][t["name"]] <= ef + 48 * partitions, (rank, t["name"], got["tensors"][t["name"]])


@pytest.mark.parametrize("ranks", [2, 4])
def test_float16_tensors_and_fp16_wire(ranks, launched):
    check(launched, ranks, "float16")


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_reducer_and_the_step_context(ranks, launched):
    """recompress, lossless and majority (a sign all_reduce here) as the parameter server runs
    them (test_cluster_reducers.py), plus a codec whose output depends on the step context."""
    results = check(launched, ranks, "reducers")
    votes = results[0]["reducers:majority-odd/2"]
    assert set(np.unique(votes)) <= {-1.0, 1.0}  # a vote, not averaged


@pytest.mark.parametrize("ranks", [2, 4])
def test_large_dense_arrays_reduced_alone_in_their_output(ranks, launched):
    check(launched, ranks, "alone")


@pytest.mark.parametrize("ranks", [2, 4])
def test_views_of_one_flat_array_reduced_in_place(ranks, launched):
    """The views' results are the oracle's (as separate arrays'), and each rank's flat arrays
    are what gloo all_reduced on every step: no copy in or out."""
    check(launched, ranks, "views")
    in_place = launched(ranks)[3]
    for rank in range(ranks):
        assert in_place[rank] == [["a", "b"] if rank % 2 else ["a"]] * 3, f"rank {rank}"
