"""bps_gc.torch.DiLoCo on the parameter server (BPS_GC_TRANSPORT=ps, ``bpslaunch --local``, two
servers), with the outer step on the workers (outer_step="workers": each fragment's
pseudo-gradient averaged by push_pull under its own declared name: torch/exchange.py's
PushPullExchange) and on the servers (reducer ``outer_sgd``, compress/outer.py: the servers keep
the global copy and the outer momentum, sharded over them, and reply the outer update), which
DiLoCo takes by default on the parameter server. After 5 outer rounds, on 2 hosts x 2 local
ranks and on 3 workers, every parameter equals test_diloco.py's single-process re-computation
within 1e-6 relative (one fragment, staggered fragments, tau = 1; dense pseudo-gradients in both
modes: on the servers through the identity codec, every tensor, the biases too, whatever
BYTEPS_MIN_COMPRESS_BYTES). The default falls back to the workers' outer step for an outer AdamW
and for thc (whose phases outer_sgd cannot decode).
On 2 hosts x 2 local ranks with each host one replica (replicate="hosts"), every rank equals
the re-computation with 2 replicas, a host's ranks hold the same bits, and each host pushes one
copy of the pseudo-gradient. With top-k + error feedback on 2 x 2, each rank a replica and each
host one, in both modes: the global copies are bit-identical on every rank; stopped mid-window
with a fragment's exchange in flight, saved (model, DiLoCo, bps_gc.torch.state_dict(), which
holds each rank's residuals and the servers' state) and resumed in a new launch, every
parameter and global copy equals a straight run's bit for bit. thc 4-bit's
phases are summed in int64 words, whose packing gives its bytes exactly. Bad settings are refused in one line."""
import json
import os
import re
import sys

import numpy as np
import pytest
import torch

from cluster import run_local
from conftest import ROOT
from test_diloco import CASES, WARM_RESUMED, build_model, recompute

JOB = os.path.join(ROOT, "tests", "diloco_ps_job.py")
COMPRESSED = {"sync_every": 4, "fragments": 2, "steps": 12, "stop_at": 4, "delay": 1, "warm": WARM_RESUMED,
              "compression_params": {"compressor": "topk", "k": 0.3, "ef": "vanilla"}}
WORKERS = 3
HOSTS, LOCAL = 2, 2  # the dense launch: bpslaunch --local --workers 2 --local-size 2
HOST_CASES = ("overlapped", "warm-overlapped")  # with each host one replica: fragments, tau, a warm phase
STATES = {"global", "pulled", "mine"}  # a run's end: its global copies, the servers' (pulled) and its own
MODES = ("workers", "servers")


def launch(tmp, phase, workers, min_compress_bytes=0, local_size=1):
    """``workers`` hosts of ``local_size`` ranks each; every rank's arrays."""
    spec = tmp / f"{phase}.json"
    spec.write_text(json.dumps({"phase": phase, "cases": CASES, "compressed": COMPRESSED, "host_cases": HOST_CASES}))
    result = run_local([sys.executable, JOB, str(spec), str(tmp)], workers=workers, servers=2, timeout=240,
                       local_size=local_size, env={"BYTEPS_MIN_COMPRESS_BYTES": str(min_compress_bytes)})
    assert result.returncode == 0, f"{phase} failed ({result.returncode}):\n{result.stderr[-5000:]}"
    return [dict(np.load(tmp / f"{phase}{r}.npz")) for r in range(workers * local_size)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three launches: on 2 hosts x 2 local ranks (two levels), where top-k's biases (64 and 16
    bytes) go uncompressed (BYTEPS_MIN_COMPRESS_BYTES 256: with the outer step on the servers,
    theirs is the workers'; dense ones go through the identity codec, at any size), top-k + EF saved mid-window, then the dense cases, each rank a
    replica and each host one (replicate="hosts"); the checkpoint resumed in a new launch of
    2 x 2; the dense cases on 3 workers, every tensor compressed."""
    tmp = tmp_path_factory.mktemp("diloco_ps")
    got = {"dense": launch(tmp, "dense", HOSTS, min_compress_bytes=256, local_size=LOCAL),
           "resumed": launch(tmp, "resumed", HOSTS, min_compress_bytes=256, local_size=LOCAL),
           "all": launch(tmp, "all", WORKERS)}
    got["checkpoints"] = [torch.load(tmp / f"ckpt{r}.pt", weights_only=True)["bps_gc"]["communicator"]
                          for r in range(HOSTS * LOCAL)]
    return got


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("phase, workers", [("dense", HOSTS * LOCAL), ("all", WORKERS)])
def test_diloco_equals_the_recomputation(runs, phase, workers, mode):
    got = runs[phase]
    for case, settings in CASES.items():
        want = recompute(*settings, replicas=workers)
        for rank in range(workers):
            for name, value in want[rank].items():
                np.testing.assert_allclose(got[rank][f"{mode}/{case}/{name}"], value, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{workers} workers, {mode}, {case}, rank {rank}, {name}")
        assert not np.array_equal(want[0]["0.weight"], build_model()[0].weight.detach().numpy())
        assert all(str(got[rank][f"{mode}/{case}/outer_step"]) == mode for rank in range(workers))  # servers': None's
        if mode == "servers":  # dense on the servers: every tensor there, the biases too
            assert list(got[0][f"{mode}/{case}/averaged"]) == []


def test_the_default_falls_back_to_the_workers(runs):
    """outer_step=None on the parameter server: the workers' outer step for an outer AdamW and
    for thc 4-bit pseudo-gradients (both made in the "all" launch)."""
    for rank in range(WORKERS):
        assert [str(runs["all"][rank][f"{what}/outer_step"]) for what in ("adamw", "thc")] == ["workers"] * 2


@pytest.mark.parametrize("phase, workers", [("dense", HOSTS * LOCAL), ("all", WORKERS)])
def test_the_servers_hold_the_global_copy(runs, phase, workers):
    """With the outer step on the servers, every worker pulls the global copy from the servers
    (DiLoCo.global_parameters()): it is each worker's own copy, bit for bit (with an exchange
    still in flight at the end, plus its update, as the servers applied it), and equals the
    re-computation's within 1e-6 relative. Dense, every tensor's is on the servers (the
    identity codec ignores BYTEPS_MIN_COMPRESS_BYTES)."""
    got = runs[phase]
    for case, settings in CASES.items():
        want = recompute(*settings, replicas=workers, servers_global=True)
        held = [name for name in want if f"servers/{case}/pulled/{name}" in got[0]]
        assert held == list(want), case
        for rank in range(workers):
            for name in held:
                pulled = got[rank][f"servers/{case}/pulled/{name}"]
                assert pulled.tobytes() == got[rank][f"servers/{case}/mine/{name}"].tobytes(), f"{case} {rank} {name}"
                np.testing.assert_allclose(pulled, want[name], rtol=1e-6, atol=1e-7, err_msg=f"{case} {rank} {name}")
    # "overlapped" ends with fragment 1's round completed on the servers only: not the parameters
    last = recompute(*CASES["overlapped"], replicas=workers)[0]["2.weight"]
    assert not np.array_equal(got[0]["servers/overlapped/pulled/2.weight"], last)


def syncs(sync_every, fragments, steps, delay, warm_steps, warm_every):
    """[the exchanges fragment f starts in ``steps`` inner steps] (DiLoCo's schedule)."""
    def turn(t, f):
        if t <= warm_steps:
            return t % warm_every == 0
        return (t - warm_steps) % sync_every == (f + 1) * sync_every // fragments % sync_every
    return [sum(turn(t, f) for t in range(1, steps + 1)) for f in range(fragments)]


@pytest.mark.parametrize("mode", MODES)
def test_a_host_is_one_replica(runs, mode):
    """replicate="hosts", 2 hosts x 2 local ranks (DDP on the host's group, each rank half the
    host's batch), two fragments with tau = 1, without and with a warm phase: every rank's
    parameters equal the re-computation with 2 replicas (the hosts) within 1e-6 relative; a
    host's ranks hold the same bits, and the global copies are the same bits on all 4 ranks.
    Each rank pushes its half of each tensor, so a host pushes one copy of the pseudo-gradient
    a sync, 4 bytes an element in both modes (on the servers, the default there, every part
    through the identity codec: the dense push's bytes). On the servers every rank's copy of
    the servers' global copy, all-gathered from the parts, is its own and the re-computation's."""
    got = runs["dense"]
    sizes = [p.numel() for p in build_model().parameters()]
    for case in HOST_CASES:
        settings = CASES[case]
        want = recompute(*settings, replicas=HOSTS)
        label = f"hosts/{mode}/{case}"
        for rank in range(HOSTS * LOCAL):
            mine = [key for key in got[rank] if key.startswith(f"{label}/")]
            for key in mine:  # parameters, global copies, pulled: the host's ranks alike
                assert got[rank][key].tobytes() == got[rank - rank % LOCAL][key].tobytes(), f"rank {rank} {key}"
            for name, value in want[rank // LOCAL].items():
                np.testing.assert_allclose(got[rank][f"{label}/{name}"], value, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{mode}, {case}, rank {rank}, {name}")
                assert got[rank][f"{label}/global/{name}"].tobytes() == got[0][f"{label}/global/{name}"].tobytes()
        per_rank = recompute(*settings, replicas=HOSTS * LOCAL)[0]["0.weight"]  # not 4 replicas: far from it
        assert np.abs(got[0][f"{label}/0.weight"] - per_rank).max() > 1e-3 * np.abs(per_rank).max()
        cuts = [len(sizes) * f // settings[1] for f in range(settings[1] + 1)]
        elements = sum(n * sum(sizes[cuts[f]:cuts[f + 1]]) for f, n in enumerate(syncs(*settings)))
        assert str(got[0][f"{label}/outer_step"]) == mode
        if mode == "servers":  # every part on the servers (identity), the servers' copy all-gathered
            assert list(got[0][f"{label}/averaged"]) == []
            want_global = recompute(*settings, replicas=HOSTS, servers_global=True)
            for rank in range(HOSTS * LOCAL):  # the servers' copy, all-gathered from the parts
                for name, value in want_global.items():
                    pulled = got[rank][f"{label}/pulled/{name}"]
                    assert pulled.tobytes() == got[rank][f"{label}/mine/{name}"].tobytes(), f"rank {rank} {name}"
                    np.testing.assert_allclose(pulled, value, rtol=1e-6, atol=1e-7)
        for host in range(HOSTS):
            pushed = [int(got[host * LOCAL + r][f"{label}/pushed_wire"]) for r in range(LOCAL)]
            assert pushed == [4 * elements // LOCAL] * LOCAL, f"{mode} {case} host {host}"


def test_a_host_replica_resumes_bit_for_bit(runs):
    """The first host case (two fragments, tau = 1, the outer step on the workers), stopped after
    step 4 with fragment 1's exchange in flight (DiLoCo.state_dict() all-gathers its parts),
    loaded into a new model and DiLoCo in the same launch and trained on: every rank ends as
    the straight run, bit for bit."""
    for rank in range(HOSTS * LOCAL):
        got = runs["dense"][rank]
        names = [key.split("/", 2)[2] for key in got if key.startswith("hosts/resumed/")]
        assert len(names) == 4
        for name in names:
            straight = got[f"hosts/workers/{HOST_CASES[0]}/{name}"]
            assert got[f"hosts/resumed/{name}"].tobytes() == straight.tobytes(), f"rank {rank} {name}"
        assert any(not np.array_equal(got[f"hosts/stopped/{n}"], got[f"hosts/resumed/{n}"]) for n in names)


@pytest.mark.parametrize("mode", MODES)
def test_a_host_replica_resumes_across_launches(runs, mode):
    """replicate="hosts" with top-k + EF (H = 4, two fragments, tau = 1), saved after step 4
    with fragment 1's exchange in flight (model, DiLoCo.state_dict(), bps_gc.torch.state_dict()
    on every rank) in the dense launch, which trains on, and resumed in a new launch of 2 x 2
    (new scheduler, servers and workers): every rank's parameters and global copies (and, on
    the servers, the servers' copy fetched at the end) equal a straight run's, never saved, bit
    for bit. Each rank's checkpoint holds the error feedback of its own part of 0.weight (the
    parts compressed; the others go uncompressed), nonzero, and, on host 0's ranks only, the
    servers' state of that part, nonzero: the error feedback of their top-k reply (outer step
    on the workers), their outer momentum and global copy (on the servers)."""
    for rank in range(HOSTS * LOCAL):
        dense, resumed = runs["dense"][rank], runs["resumed"][rank]
        names = [key.split("/", 3)[3] for key in dense if key.startswith(f"hosts/straight/{mode}/")]
        assert len(names) == (10 if mode == "servers" else 8)  # parameters, global copies (0.weight's pulled, mine)
        for name in names:
            want = dense[f"hosts/straight/{mode}/{name}"].tobytes()
            assert resumed[f"hosts/resumed/{mode}/{name}"].tobytes() == want, f"rank {rank} {name}: resumed"
            assert dense[f"hosts/first_end/{mode}/{name}"].tobytes() == want, f"rank {rank} {name}: saving changed it"
        kept, part = runs["checkpoints"][rank], f"0.weight#part{rank % LOCAL}/"
        index = 4 if mode == "workers" else 5  # exchange.<index>: the order the DiLoCos were made in
        mine = [v for k, v in kept.items() if k.startswith(f"worker/exchange.{index}.") and part in k]
        assert mine and all(f"#part{rank % LOCAL}/" in k for k in kept if k.startswith("worker/") and "#part" in k)
        assert sum(float(v.abs().sum()) for v in mine if isinstance(v, torch.Tensor)) > 0, f"rank {rank}"
        held = {k.rsplit("/", 1)[1]: v for k, v in kept.items()
                if k.startswith(f"server/exchange.{index}.") and part in k}
        if rank >= LOCAL:  # host 0's local rank i restores its part's servers' state, host 1's none
            assert not held, f"rank {rank}"
        else:  # the servers' recompression's error feedback; their outer momentum and global copy
            wanted = ["chain.ef.error"] if mode == "workers" else ["momentum", "global_copy"]
            assert all(float(held[k].abs().sum()) > 0 for k in wanted), f"rank {rank} {sorted(held)}"


@pytest.mark.parametrize("mode", MODES)
def test_compressed_global_copies_are_bit_identical_on_every_worker(runs, mode):
    """Top-k + EF, each of the 2 x 2 ranks a replica (the biases uncompressed: 256 bytes)."""
    got = runs["dense"]
    names = [name for name in got[0] if name.startswith(f"{mode}/straight/global/")]
    assert len(names) == 4
    for rank in range(1, HOSTS * LOCAL):
        for name in names:
            assert got[rank][name].tobytes() == got[0][name].tobytes(), f"rank {rank} {name}"
    if mode == "servers":  # top-k's pseudo-gradients: the servers' copy is every worker's too
        held = [name for name in got[0] if name.startswith("servers/straight/pulled/")]
        assert [name.rsplit("/", 1)[1] for name in held] == ["0.weight", "2.weight"]
        for rank in range(HOSTS * LOCAL):
            for name in held:
                assert got[rank][name].tobytes() == got[rank][name.replace("/pulled/", "/mine/")].tobytes(), rank
    # top-k did compress: the run is not the dense one
    dense = recompute(COMPRESSED["sync_every"], COMPRESSED["fragments"], COMPRESSED["steps"], COMPRESSED["delay"],
                      replicas=HOSTS * LOCAL)
    assert max(np.abs(got[0][f"{mode}/straight/{n}"] - v).max() / np.abs(v).max() for n, v in dense[0].items()) > 1e-3


DENSE = "exchange.6."  # the dense run's tensors: the 7th DiLoCo made (compressed_runs())


def test_dense_on_the_servers_resumes_bit_for_bit(runs):
    """The same settings with dense pseudo-gradients and DiLoCo's default outer step (the
    servers', every tensor through the identity codec: BYTEPS_MIN_COMPRESS_BYTES 256 leaves none
    raw), saved and resumed with the others: parameters, global copies and the servers' copy of
    every tensor equal the straight run's bit for bit; the checkpoint holds every tensor's outer
    momentum and global copy (the biases' too), nonzero, once."""
    for rank in range(HOSTS * LOCAL):
        every, resumed = runs["dense"][rank], runs["resumed"][rank]
        names = [n.split("/", 2)[2] for n in every if n.startswith("dense/straight/")]
        assert len(names) == 16  # parameters, global copies, pulled and mine, of 4 tensors
        for name in names:
            assert resumed[f"dense/resumed/{name}"].tobytes() == every[f"dense/straight/{name}"].tobytes(), name
            assert every[f"dense/first_end/{name}"].tobytes() == every[f"dense/straight/{name}"].tobytes(), name
    held = {}
    for kept in runs["checkpoints"]:
        for key, value in kept.items():
            if key.startswith(f"server/{DENSE}"):
                name, attr = key[len(f"server/{DENSE}"):].split("/")[0], key.rsplit("/", 1)[1]
                held.setdefault((name, attr), []).append(float(value.abs().sum()))
    names = [name for name, _ in build_model().named_parameters()]
    assert sorted(held) == sorted((n, a) for n in names for a in ("global_copy", "momentum"))
    assert all(len(sums) == 1 and sums[0] > 0 for sums in held.values()), held


@pytest.mark.parametrize("mode", MODES)
def test_resumed_in_the_middle_of_a_window_equals_the_straight_run(runs, mode):
    """Each of the 2 x 2 ranks a replica, H = 4, two fragments, tau = 1: saved after step 4,
    when fragment 1's exchange (started after step 4) is in flight and fragment 0 has taken one
    outer step; resumed in a new launch (new servers: on the servers, the momentum and global
    copy come back from the checkpoint): parameters, global copies and the servers' copy equal
    a straight run's bit for bit. The saving launch, trained on, ends bit-identical to the
    straight run too (runs repeat, saving changes nothing). So does the same run with a warm
    phase (WARM_RESUMED, "warm/"), stopped inside it with its exchange of step 4 in flight and
    resumed across the switch to DiLoCo."""
    for rank in range(HOSTS * LOCAL):
        every, resumed = runs["dense"][rank], runs["resumed"][rank]
        names = [n.split("/", 2)[2] for n in every if n.startswith(f"{mode}/straight/")]
        assert sum(n.startswith("warm/") for n in names) == (12 if mode == "servers" else 8)  # global, pulled, mine
        for name in names:
            straight = every[f"{mode}/straight/{name}"].tobytes()
            assert resumed[f"{mode}/resumed/{name}"].tobytes() == straight, f"rank {rank} {name}: resumed"
            assert every[f"{mode}/first_end/{name}"].tobytes() == straight, f"rank {rank} {name}: runs differ"
        for warm in (False, True):  # each run trained on after the stop
            trained = [n for n in names if n.startswith("warm/") == warm and not STATES & set(n.split("/"))]
            assert any(not np.array_equal(every[f"{mode}/first/{n}"], every[f"{mode}/straight/{n}"]) for n in trained)
        for name in (n for n in names if n.startswith("pulled/")):  # the resumed servers' copy: the straight run's
            assert resumed[f"{mode}/resumed/{name.replace('pulled/', 'mine/')}"].tobytes() == \
                every[f"{mode}/straight/{name}"].tobytes(), f"rank {rank} {name}"
    if mode == "servers":  # the servers' outer momentum and global copy are in the checkpoints
        saved = [(key, value) for kept in runs["checkpoints"] for key, value in kept.items()
                 if key.startswith("server/") and "#part" not in key and not key.startswith(f"server/{DENSE}")]
        momentum = [value for key, value in saved if key.endswith("/momentum")]
        assert momentum and sum(float(m.abs().sum()) for m in momentum) > 0  # the warm run's: none yet
        held = [value for key, value in saved if key.endswith("/global_copy")]
        assert len(held) == len(momentum) and all(float(g.abs().sum()) > 0 for g in held)


def test_thc_words_are_int64_and_the_bytes_are_their_packing(runs):
    """thc 4-bit at H = 4, 8 inner steps (2 syncs), 3 workers, in the "all" launch: every server
    says it adds int64, so the phase tensors are int64 and each sync pushes, per parameter
    tensor of n elements, 8-byte words: the 160 scale counts in 2-bit lanes (bit_length(3)),
    32 a word, so 5; 3 header words; the codes in 6-bit lanes (4 bits + ceil(log2 3)), 10 a
    word (float64 words would hold 26 and 8 lanes)."""
    steps, syncs = 8, 2
    per_sync = sum(8 * (5 + 3 + -(-p.numel() // 10)) for p in build_model().parameters())
    for rank in range(WORKERS):
        assert list(runs["all"][rank]["thc/phase_dtypes"]) == ["int64"], f"rank {rank}"
        assert int(runs["all"][rank]["thc/pushed_wire"]) / steps == syncs * per_sync / steps, f"rank {rank}"


def test_a_process_group_is_refused_on_the_parameter_server(runs):
    message = str(runs["all"][0]["refused"])
    assert message.startswith("DiLoCo: the parameter server averages over every worker") and "\n" not in message


def test_other_initial_parameters_are_refused_on_the_servers(runs):
    message = str(runs["all"][1]["differs"])
    assert message == ("DiLoCo: worker 1's initial 0.weight differs from worker 0's: every replica must start "
                       "from the same parameters (build the model from one seed)")
    assert "differs" not in runs["all"][0] and "differs" not in runs["all"][2]


@pytest.mark.parametrize("kwargs, message", [
    ({"compression_params": {"compressor": "thc"}},
     "DiLoCo: the servers' outer step: compressor 'thc' does not support reducer 'outer_sgd'"),
    ({"outer_optimizer": lambda params: torch.optim.AdamW(params)}, "the servers' outer step is torch.optim.SGD's; got AdamW"),
    ({"outer_optimizer": lambda params: torch.optim.SGD(params, lr=0.7, weight_decay=0.1)}, "got {'weight_decay': 0.1}"),
    ({}, "reducer 'outer_sgd' runs on the parameter server's servers"),  # this process: no parameter server
    ({"outer_step": "server"}, "outer_step must be 'workers', 'servers' or None"),
])
def test_bad_servers_settings_are_refused(kwargs, message):
    from bps_gc.torch import DiLoCo
    model = build_model()
    settings = {"outer_step": "servers", "compression_params": {"compressor": "topk", "k": 0.3}, **kwargs}
    with pytest.raises(ValueError, match=message) as refused:
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 4, **settings)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("replicate, message", [
    ("host", "DiLoCo: replicate must be a process group or 'hosts', got 'host'"),
    ("hosts", "DiLoCo: replicate='hosts' makes each host of the parameter server one replica"),  # no bps init
])
def test_bad_replicas_are_refused(replicate, message):
    from bps_gc.torch import DiLoCo
    model = build_model()
    with pytest.raises(ValueError, match=f"^{re.escape(message)}") as refused:
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 4, replicate=replicate)
    assert "\n" not in str(refused.value)


def test_the_global_parameters_are_on_the_servers_only_with_their_outer_step():
    from bps_gc.torch import DiLoCo
    model = build_model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4)
    with pytest.raises(ValueError, match="on the servers with outer_step='servers' only; this one keeps them on"):
        opt.global_parameters()


def test_a_checkpoint_of_the_other_outer_step_is_refused():
    from bps_gc.torch import DiLoCo
    model = build_model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4)
    saved = {**opt.state_dict(), "outer_step": "servers", "steps": 7}
    saved["fragments"][0]["copies"] = [c + 1 for c in saved["fragments"][0]["copies"]]
    before = [p.clone() for p in opt.fragments[0].copies]
    with pytest.raises(ValueError, match="made with outer_step='servers'; this one has outer_step='workers'"):
        opt.load_state_dict(saved)
    assert opt.steps == 0 and all(torch.equal(a, b) for a, b in zip(before, opt.fragments[0].copies))
