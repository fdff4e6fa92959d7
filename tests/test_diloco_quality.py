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
    # the tolerance tells steps apart: half the outer step is not DDP's
    half = study.diloco(replicas=2, steps=6, every=1, outer_lr=0.5, momentum=0.0)
    assert abs(half[-1][1] - ddp[-1][1]) > 1e-3
