"""bps_gc.torch.DiLoCo against a straightforward single-process re-computation: two replicas
(2 gloo ranks under torchrun) each take H inner SGD steps on their own batches; each fragment,
at its turn, averages its pseudo-gradient (global - local), takes the outer Nesterov SGD step
(lr 0.7, momentum 0.9) on the global copy and resets the local parameters to it. Dense, after 5
outer rounds, every parameter equals the re-computation within 1e-6 relative, with one
fragment and with staggered fragments, and after a warm phase of plain averaging (docs/diloco.md
"A warm phase"). bps_gc.torch.metrics() counts the exchanges' bytes: thc 4-bit
at H = 100 pushes at most 1/500 of DDP dense's bytes per step (issue 44's bytes target). Bad
settings are refused in one line."""
import numpy as np
import pytest
import torch

from collective_cluster import run_torchrun_job

# (sync_every, fragments, inner steps, delay, warm_steps, warm_every)
CASES = {"one-fragment": (3, 1, 15, 0, 0, None), "two-fragments": (4, 2, 20, 0, 0, None),
         "overlapped": (4, 2, 20, 1, 0, None), "warm": (3, 1, 15, 0, 4, 2), "warm-overlapped": (4, 2, 22, 1, 6, 3)}
# scripts/diloco_quality.py's tiny LM: 2 warm rounds (every 2 steps), then 2 outer rounds at H = 3
STUDY = {"argv": ["--layers", "1", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
                  "--val-windows", "16", "--warmup", "2"], "steps": 10, "every": 3, "outer_lr": 1.0, "warm": 4,
         "warm_every": 2}
# the resume tests' warm run, in lockstep with their first: stopped in its warm phase, an exchange in flight
WARM_RESUMED = {"warm_steps": 6, "warm_every": 2}
# issue 44's bytes target: thc 4-bit pseudo-gradients at H = 100, two syncs
BYTES = {"sync_every": 100, "steps": 200, "compression_params": {"compressor": "thc", "bits": 4}}


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def build_wide_model():
    """33,088 parameters in 4 tensors: thc's per-tensor overhead (its scale phase and header,
    64 bytes a tensor here) is small beside the codes, as in a real model's large tensors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))


def wide_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g)


def recompute(sync_every, fragments, steps, delay, warm_steps=0, warm_every=None, replicas=2, servers_global=False):
    """Every replica's model in one process, DiLoCo written out by hand: a fragment's
    pseudo-gradient is taken at its turn and applied ``delay`` inner steps later; in the first
    ``warm_steps`` steps every fragment's is taken every ``warm_every`` steps, and applied with
    lr 1 and no momentum (the global copy becomes the replicas' mean); the turns count from there.
    ``servers_global``: instead, the global copy once the rounds still in flight at the end
    have completed too (what the servers hold with the outer step on them)."""
    models = [build_model() for _ in range(replicas)]
    inners = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    params = [list(m.parameters()) for m in models]
    count = len(params[0])
    cuts = [count * f // fragments for f in range(fragments + 1)]
    glob = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(p) for p in glob]
    taken = {}  # fragment -> (due step, warm?, its averaged pseudo-gradients)

    def turn(done, f):
        if done <= warm_steps:
            return done % warm_every == 0
        return (done - warm_steps) % sync_every == (f + 1) * sync_every // fragments % sync_every

    def apply(f):
        _, warm, deltas = taken.pop(f)
        for i, delta in deltas.items():
            if warm:
                glob[i] -= delta
            else:
                outer_step(glob, momentum, i, delta)
            for ps in params:
                ps[i].copy_(glob[i])
    for step in range(steps):
        for rank, (model, inner) in enumerate(zip(models, inners)):
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
            inner.zero_grad()
        done = step + 1
        for f in range(fragments):
            with torch.no_grad():
                if f in taken and taken[f][0] == done:
                    apply(f)
                if turn(done, f):
                    taken[f] = (done + delay, done <= warm_steps,
                                {i: sum((glob[i] - ps[i]) / replicas for ps in params) for i in range(cuts[f], cuts[f + 1])})
                if f in taken and taken[f][0] == done:
                    apply(f)
    names = [name for name, _ in models[0].named_parameters()]
    if servers_global:
        with torch.no_grad():
            for f in list(taken):
                apply(f)
        return {name: g.detach().numpy() for name, g in zip(names, glob)}
    return [{name: p.detach().numpy() for name, p in zip(names, ps)} for ps in params]


def outer_step(glob, momentum, i, delta):
    momentum[i] = 0.9 * momentum[i] + delta  # torch's SGD: buf = mu * buf + g
    glob[i] -= 0.7 * (delta + 0.9 * momentum[i])  # Nesterov


# the resume test's run (diloco_resume_job.py); its straight phase runs last in the launch above
RESUME = {"sync_every": 4, "fragments": 2, "steps": 12, "stop_at": 4, "delay": 1, "warm": WARM_RESUMED,
          "compression_params": {"compressor": "topk", "k": 0.3, "ef": "vanilla"}}


@pytest.fixture(scope="module")
def launch_folder(tmp_path_factory):
    """The folder of one diloco_job.py launch: the dense cases, the bytes run, the study, then
    the resume test's straight run."""
    tmp = tmp_path_factory.mktemp("diloco")
    run_torchrun_job("diloco_job.py", {"cases": CASES, "bytes": BYTES, "study": STUDY, "straight": RESUME}, tmp, 2)
    return tmp


@pytest.fixture(scope="module")
def launched(launch_folder):
    """Each rank's results of that launch."""
    return [dict(np.load(launch_folder / f"rank{r}.npz")) for r in range(2)]


def test_dense_diloco_equals_the_recomputation(launched):
    got = launched
    for case, settings in CASES.items():
        want = recompute(*settings)
        for rank in range(2):
            for name, value in want[rank].items():
                np.testing.assert_allclose(got[rank][f"{case}/{name}"], value, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{case} rank {rank} {name}")
            assert str(got[rank][f"{case}/outer_step"]) == "workers"  # DiLoCo's default here
        # the last inner steps ran after the last sync: replicas differ only where a fragment synced last
        assert not np.array_equal(want[0]["0.weight"], build_model()[0].weight.detach().numpy())
        if settings[4]:  # the warm phase changes the result: the 1e-6 above tells it apart
            cold = recompute(*settings[:4])[0]["0.weight"]
            assert np.abs(cold - want[0]["0.weight"]).max() > 1e-3 * np.abs(cold).max(), case


def test_the_studys_warm_phase_is_the_apis(launched):
    """scripts/diloco_quality.py --warm-start 4 --warm-every 2 (the tiny LM, AdamW, clipping, 2
    replicas simulated in one process) and bps_gc.torch.DiLoCo(warm_steps=4, warm_every=2) on 2
    ranks end on the same global copy, bit for bit: the same rounds, the same plain averages,
    the outer Nesterov momentum started at the switch (both single-threaded; the dense
    average of 2 is one sum and one division either way). Without the warm phase the study
    ends elsewhere, and the copy is not the initial parameters."""
    import os
    import sys
    from conftest import ROOT
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import diloco_quality
    from lm_training import build_model as build_lm
    study = diloco_quality.Study(diloco_quality.parse_args(STUDY["argv"]))
    settings = {k: STUDY[k] for k in ("steps", "every", "outer_lr")}
    study.diloco(2, **settings, momentum=0.9, warm=STUDY["warm"], warm_every=STUDY["warm_every"])
    want = [c.numpy().copy() for c in study.global_copy]
    study.diloco(2, **settings, momentum=0.9)
    cold = [c.numpy() for c in study.global_copy]
    lm = build_lm(study.settings(STUDY["steps"]), torch.device("cpu"))
    for (name, _), value in zip(lm.named_parameters(), want):
        for rank in range(2):
            assert launched[rank][f"study/{name}"].tobytes() == value.tobytes(), f"rank {rank} {name}"
    assert max(np.abs(v - o).max() / np.abs(v).max() for v, o in zip(want, cold)) > 1e-3
    assert max(np.abs(v - p.detach().numpy()).max() for v, (_, p) in zip(want, lm.named_parameters())) > 1e-3


def test_metrics_count_diloco_bytes_and_thc_at_h_100_sends_under_1_in_500(launched):
    """Dense, every sync pushes its fragment's float32 pseudo-gradient: 4 bytes a parameter for
    each of the steps // H syncs of every fragment, exactly (a delayed exchange is counted when it
    starts). thc 4-bit at H = 100, two syncs: bytes per inner step (pushed, per rank, the LM
    yardstick's measure) at most 1/500 of DDP dense's, 4 bytes x parameters every step; and at
    least the 4-bit codes themselves, so the count is not empty."""
    dense_params = sum(p.numel() for p in build_model().parameters())
    wide_params = sum(p.numel() for p in build_wide_model().parameters())
    for rank in range(2):
        for case, (sync_every, _, steps, _, warm_steps, warm_every) in CASES.items():
            syncs = (warm_steps // warm_every if warm_steps else 0) + (steps - warm_steps) // sync_every
            want = syncs * 4 * dense_params
            assert int(launched[rank][f"{case}/pushed_wire"]) == want, f"{case} rank {rank}"
        pushed, steps = int(launched[rank]["bytes/pushed_wire"]), BYTES["steps"]
        syncs = steps // BYTES["sync_every"]
        assert pushed >= syncs * wide_params * 4 // 8, f"rank {rank}: {pushed} bytes, less than the codes"
        ddp_per_step = 4 * wide_params
        assert pushed / steps <= ddp_per_step / 500, (f"rank {rank}: {pushed / steps:.1f} bytes per inner step, "
                                                      f"1/{ddp_per_step * steps / pushed:.0f} of DDP dense's")


def test_resumed_in_the_middle_of_a_window_equals_the_straight_run(launch_folder, tmp_path):
    """top-k + error feedback, two staggered fragments, each exchange overlapping one inner step
    (H = 4: fragment 0's exchanges start after steps 2, 6, 10, fragment 1's after 4, 8, 12, each
    applied a step later): stopped after 4 steps, with fragment 1's exchange in flight, saved
    (model, DiLoCo's global copies, outer state and the exchange's average, the codecs'
    residuals), resumed in new processes. The first launch trains on after saving: it ends
    bit-identical to the straight launch (runs repeat, and saving changes nothing). In the same
    launches and checkpoint, the same DiLoCo with a warm phase (WARM_RESUMED: plain averaging
    every 2 steps for 6) is stopped inside it, with its exchange of step 4 in flight, and resumed
    across the switch to DiLoCo: bit-identical too. The straight run is the last run of the
    module's diloco_job.py launch (launch_folder, torchrun): one launch fewer; the two resume
    launches under bpslaunch --servers 0 (the same gloo ranks, without torchrun's agent)."""
    for phase in ("first", "resumed"):
        run_torchrun_job("diloco_resume_job.py", {**RESUME, "phase": phase}, tmp_path, 2, launcher="bpslaunch")
    for rank in range(2):
        straight, resumed = np.load(launch_folder / f"straight{rank}.npz"), np.load(tmp_path / f"resumed{rank}.npz")
        first = np.load(tmp_path / f"first{rank}.npz")
        assert len(straight.files) == 8  # both runs' parameters
        for name in straight.files:
            assert straight[name].tobytes() == resumed[name].tobytes(), f"rank {rank} {name}"
        for warm in (False, True):  # each run trained on after the stop
            names = [n for n in straight.files if n.startswith("warm/") == warm]
            assert any(not np.array_equal(straight[n], first[n]) for n in names), f"warm {warm}"
        first_end = np.load(tmp_path / f"first_end{rank}.npz")
        # under bps_gc.torch.init() on torch.distributed, DiLoCo's default is the workers' outer step
        assert torch.load(tmp_path / f"ckpt{rank}.pt", weights_only=True)["diloco"]["outer_step"] == "workers"
        for name in straight.files:
            assert straight[name].tobytes() == first_end[name].tobytes(), f"rank {rank} {name}: runs differ"


@pytest.mark.parametrize("kwargs, message", [
    ({"sync_every": 0}, "sync_every must be a whole number"),
    ({"sync_every": 4, "fragments": 5}, "fragments must be between 1"),
    ({"sync_every": 4, "outer_optimizer": lambda params: object()}, "must return a torch.optim.Optimizer"),
    ({"sync_every": 4, "alpha": 1.0}, "alpha must be in"),
    ({"sync_every": 4, "fragments": 2, "delay": 2}, "delay must be a whole number"),
    ({"sync_every": 4, "warm_steps": -2, "warm_every": 1}, "warm_steps must be a whole number of inner steps >= 0"),
    ({"sync_every": 4, "warm_steps": 4, "warm_every": 0}, r"warm_every must be .* that divides warm_steps \(4\), got 0"),
    ({"sync_every": 4, "warm_steps": 4, "warm_every": 3}, r"divides warm_steps \(4\), got 3"),
    ({"sync_every": 4, "warm_steps": 4}, r"divides warm_steps \(4\), got None"),
    ({"sync_every": 4, "warm_every": 2}, "warm_every=2 needs warm_steps > 0"),
    ({"sync_every": 4, "warm_steps": 4, "warm_every": 1, "delay": 1}, r"warm_every \(1\) must exceed delay \(1\)"),
])
def test_bad_settings_are_refused(kwargs, message):
    from bps_gc.torch import DiLoCo
    model = build_model()
    with pytest.raises((ValueError, TypeError), match=message) as refused:
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert "\n" not in str(refused.value)


def test_a_checkpoint_of_another_h_is_refused():
    from bps_gc.torch import DiLoCo
    model = build_model()
    saved = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4).state_dict()
    with pytest.raises(ValueError, match="sync_every=4 and 1 fragments; this one has sync_every=8"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=8).load_state_dict(saved)
    warm = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, warm_steps=6, warm_every=2)
    with pytest.raises(ValueError, match="made with warm_steps=0, warm_every=None; this one has warm_steps=6, "
                                         "warm_every=2"):
        warm.load_state_dict(saved)
    assert warm.steps == 0
