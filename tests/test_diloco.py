"""bps_gc.torch.DiLoCo against a straightforward single-process re-computation: two replicas
(2 gloo ranks under torchrun) each take H inner SGD steps on their own batches; each fragment,
at its turn, averages its pseudo-gradient (global - local), takes the outer Nesterov SGD step
(lr 0.7, momentum 0.9) on the global copy and resets the local parameters to it. Dense, after 5
outer rounds, every parameter equals the re-computation within 1e-6 relative, with one
fragment and with staggered fragments. Bad settings are refused in one line."""
import numpy as np
import pytest
import torch

from collective_cluster import run_torchrun_job

# (sync_every, fragments, inner steps, delay)
CASES = {"one-fragment": (3, 1, 15, 0), "two-fragments": (4, 2, 20, 0), "overlapped": (4, 2, 20, 1)}


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def recompute(sync_every, fragments, steps, delay, replicas=2):
    """Every replica's model in one process, DiLoCo written out by hand: a fragment's
    pseudo-gradient is taken at its turn and applied ``delay`` inner steps later."""
    models = [build_model() for _ in range(replicas)]
    inners = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    params = [list(m.parameters()) for m in models]
    count = len(params[0])
    cuts = [count * f // fragments for f in range(fragments + 1)]
    glob = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(p) for p in glob]
    taken = {}  # fragment -> (due step, its averaged pseudo-gradients)
    for step in range(steps):
        for rank, (model, inner) in enumerate(zip(models, inners)):
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
            inner.zero_grad()
        for f in range(fragments):
            with torch.no_grad():
                if (step + 1) % sync_every == (f + 1) * sync_every // fragments % sync_every:
                    taken[f] = (step + 1 + delay, {i: sum((glob[i] - ps[i]) / replicas for ps in params)
                                                   for i in range(cuts[f], cuts[f + 1])})
                if f not in taken or taken[f][0] != step + 1:
                    continue
                for i, delta in taken.pop(f)[1].items():
                    momentum[i] = 0.9 * momentum[i] + delta  # torch's SGD: buf = mu * buf + g
                    glob[i] -= 0.7 * (delta + 0.9 * momentum[i])  # Nesterov
                    for ps in params:
                        ps[i].copy_(glob[i])
    names = [name for name, _ in models[0].named_parameters()]
    return [{name: p.detach().numpy() for name, p in zip(names, ps)} for ps in params]


def test_dense_diloco_equals_the_recomputation(tmp_path):
    run_torchrun_job("diloco_job.py", {"cases": CASES}, tmp_path, 2)
    got = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for case, settings in CASES.items():
        want = recompute(*settings)
        for rank in range(2):
            for name, value in want[rank].items():
                np.testing.assert_allclose(got[rank][f"{case}/{name}"], value, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{case} rank {rank} {name}")
        # the last inner steps ran after the last sync: replicas differ only where a fragment synced last
        assert not np.array_equal(want[0]["0.weight"], build_model()[0].weight.detach().numpy())


def test_resumed_in_the_middle_of_a_window_equals_the_straight_run(tmp_path):
    """top-k + error feedback, two staggered fragments, each exchange overlapping one inner step
    (H = 4: fragment 0's exchanges start after steps 2, 6, 10, fragment 1's after 4, 8, 12, each
    applied a step later): stopped after 4 steps, with fragment 1's exchange in flight, saved
    (model, DiLoCo's global copies, outer state and the exchange's average, the codecs'
    residuals), resumed in new processes. The first launch trains on after saving: it ends
    bit-identical to the straight launch (runs repeat, and saving changes nothing)."""
    spec = {"sync_every": 4, "fragments": 2, "steps": 12, "stop_at": 4, "delay": 1,
            "compression_params": {"compressor": "topk", "k": 0.3, "ef": "vanilla"}}
    for phase in ("straight", "first", "resumed"):
        run_torchrun_job("diloco_resume_job.py", {**spec, "phase": phase}, tmp_path, 2)
    for rank in range(2):
        straight, resumed = np.load(tmp_path / f"straight{rank}.npz"), np.load(tmp_path / f"resumed{rank}.npz")
        first = np.load(tmp_path / f"first{rank}.npz")
        for name in straight.files:
            assert straight[name].tobytes() == resumed[name].tobytes(), f"rank {rank} {name}"
        assert any(not np.array_equal(straight[n], first[n]) for n in straight.files)
        first_end = np.load(tmp_path / f"first_end{rank}.npz")
        for name in straight.files:
            assert straight[name].tobytes() == first_end[name].tobytes(), f"rank {rank} {name}: runs differ"


@pytest.mark.parametrize("kwargs, message", [
    ({"sync_every": 0}, "sync_every must be a whole number"),
    ({"sync_every": 4, "fragments": 5}, "fragments must be between 1"),
    ({"sync_every": 4, "outer_optimizer": lambda params: object()}, "must return a torch.optim.Optimizer"),
    ({"sync_every": 4, "alpha": 1.0}, "alpha must be in"),
    ({"sync_every": 4, "fragments": 2, "delay": 2}, "delay must be a whole number"),
])
def test_bad_settings_are_refused(kwargs, message):
    from bps_gc.torch import DiLoCo
    model = build_model()
    with pytest.raises((ValueError, TypeError), match=message):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_a_checkpoint_of_another_h_is_refused():
    from bps_gc.torch import DiLoCo
    model = build_model()
    saved = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4).state_dict()
    with pytest.raises(ValueError, match="sync_every=4 and 1 fragments; this one has sync_every=8"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=8).load_state_dict(saved)
