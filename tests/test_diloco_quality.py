"""scripts/diloco_quality.py's one-process DiLoCo (issue 44's Quality study): with an inner
SGD without momentum, weight decay or clipping, H = 1 and an outer SGD of lr 1 without momentum,
each outer round sets the global copy to the replicas' mean, which is one SGD step on the
replicas' averaged gradient: DDP's step. So the two curves must agree, which fails if a
replica trains on another's shard, if the pseudo-gradients are not averaged, or if the
replicas do not restart from the global copy; a warm start of DDP steps keeps it."""
import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import diloco_quality  # noqa: E402


def test_one_process_diloco_at_h_1_with_linear_steps_equals_ddp():
    args = diloco_quality.parse_args(["--layers", "1", "--width", "16", "--heads", "2", "--context", "16",
                                      "--batch-size", "4", "--val-windows", "16", "--optimizer", "sgd",
                                      "--lr", "0.5", "--momentum", "0", "--wd", "0", "--clip", "0", "--warmup", "2"])
    study = diloco_quality.Study(args)
    ddp = study.ddp(replicas=2, steps=6, eval_every=1)
    diloco = study.diloco(replicas=2, steps=6, every=1, outer_lr=1.0, momentum=0.0)
    assert [s for s, _ in diloco] == [s for s, _ in ddp] == list(range(7))
    assert ddp[-1][1] < ddp[0][1] - 0.05  # it trained: the identity is not two untouched models
    for (s, want), (_, got) in zip(ddp, diloco):
        assert abs(got - want) <= 1e-5 * abs(want), (s, got, want)
    # a warm start of 3 DDP steps (the replicas' mean gradient) and then the same identity
    warm = study.diloco(replicas=2, steps=6, every=1, outer_lr=1.0, momentum=0.0, warm=3)
    assert [s for s, _ in warm] == [0, 4, 5, 6]
    assert abs(warm[-1][1] - ddp[-1][1]) <= 1e-5 * ddp[-1][1]
    # a warm start of plain averaging every step (--warm-every 1) is DDP's too, whatever the outer
    # step after it: its 3 rounds match DDP's steps, the half outer steps after them do not
    plain = study.diloco(replicas=2, steps=6, every=1, outer_lr=0.5, momentum=0.0, warm=3, warm_every=1)
    assert [s for s, _ in plain] == list(range(7))
    for (s, want), (_, got) in zip(ddp[:4], plain[:4]):
        assert abs(got - want) <= 1e-5 * abs(want), (s, got, want)
    assert abs(plain[-1][1] - ddp[-1][1]) > 1e-3
    # the tolerance tells steps apart: half the outer step is not DDP's
    half = study.diloco(replicas=2, steps=6, every=1, outer_lr=0.5, momentum=0.0)
    assert abs(half[-1][1] - ddp[-1][1]) > 1e-3


def test_thc_mean_is_the_numpy_recomputation_and_its_error_feedback_closes_the_gap():
    """ThcMean (--thc-bits): round 1 equals a numpy recomputation of thc's nearest-rounded
    4-bit codes against the shared scale 2^ceil(log2 max|x|) over the replicas; repeated on the
    same pseudo-gradients, error feedback makes the rounds' running mean approach the true mean."""
    import numpy as np
    import torch
    rng = np.random.default_rng(0)
    deltas = [torch.from_numpy(rng.standard_normal((3, 40)).astype(np.float32)) for _ in range(3)]
    mean = diloco_quality.ThcMean([torch.zeros(3, 40)], replicas=3, bits=4)
    got = mean(0, deltas)
    scale = 2.0 ** np.ceil(np.log2(max(float(d.abs().max()) for d in deltas)))
    codes = [np.floor((d.numpy() / scale + 1) * 15 / 2 + 0.5) for d in deltas]
    want = np.mean([scale * (2 * q / 15 - 1) for q in codes], axis=0)
    true = np.mean([d.numpy() for d in deltas], axis=0)
    assert got.shape == (3, 40) and got.dtype == torch.float32
    assert np.abs(got.numpy() - want).max() <= 1e-6 * scale
    assert 0.01 * scale < np.abs(got.numpy() - true).max() <= scale / 15  # quantized, within one code step
    rounds = [got] + [mean(0, deltas) for _ in range(19)]
    assert np.abs(torch.stack(rounds).mean(0).numpy() - true).max() <= scale / 15 / 20 * 1.01
