"""Issue 33: the seeds' PyTorch scripts resume with their codec state. Each runs twice on 2
gloo ranks at a tiny size: straight, which copies its first checkpoint into another folder as
it writes it (tests/interrupted_run.py's COPY_TO: what a run interrupted right after that
checkpoint leaves, without a launch for it), then the same command in that folder, resuming.
Two launches hold the four runs (tests/runs_job.py: a launch's 2 ranks start once, each run
its own bps_gc init() to shutdown()): one under torchrun runs both scripts straight, one
under bpslaunch --servers 0 (torch.distributed as under torchrun, without torchrun's agent)
resumes both, so each resumed run is new processes under the other launcher. The scripts are
deterministic: both end with the same parameters on every rank, bit for bit (without the codec
state they would not: test_restart_state.py). CHOCO's and local SGD's script resume in
test_cifar10_choco.py, from its torchrun runs, the study's ImageNet script in
test_study_scripts.py, from its run of the seed's command."""
import os
import subprocess

import pytest

from collective_cluster import bpslaunch_argv, job_env, runs_job_argv, torchrun_argv
from conftest import ROOT
from test_cifar10_choco import write_cifar10
from test_pytorch_examples import write_cifar100

torch = pytest.importorskip("torch")
EXAMPLES = os.path.join(ROOT, "example", "pytorch")
INTERRUPT = os.path.join(ROOT, "tests", "interrupted_run.py")
DGC_TRAIN = os.path.join(EXAMPLES, "dgc", "train.py")
DGC_ARGV = ["--configs", "configs/cifar/resnet20.py", "configs/dgc/wm5.py", "--configs.dataset.root", "data",
            "--configs.train.batch_size", "8", "--configs.data.num_threads_per_worker", "0",
            "--configs.train.num_epochs", "2"]
DGC_RUN = "[cifar.resnet20+dgc.wm5].np2"
CIFAR100 = os.path.join(EXAMPLES, "train_cifar100_byteps_gc.py")
CIFAR100_ARGV = ["--data-dir", "data", "--batch-size", "8", "-j", "0", "--save-dir", "params", "--save-period", "1",
                 "--num-epochs", "2", "--compressor", "topk", "--k", "0.05", "--ef", "vanilla"]


def launch(launcher, runs, folder):
    """``runs`` (runs_job.py's) in one launch of 2 ranks under ``launcher``."""
    env = {k: v for k, v in job_env().items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL"))}
    result = subprocess.run(launcher(runs_job_argv(runs, folder), 2), cwd=folder, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def straight_run(script, argv, folder, interrupt, copy_to):
    """A run of ``script`` in ``folder`` that copies its checkpoint ``interrupt`` (INTERRUPT_AFTER's
    MARKER:COUNT) into ``copy_to`` as it writes it, and trains on."""
    return {"script": INTERRUPT, "cwd": str(folder), "argv": [script, *argv],
            "env": {"INTERRUPT_AFTER": interrupt, "COPY_TO": str(copy_to)}}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """{script: (straight run's folder, resumed run's folder)}: the torchrun launch runs both
    straight, each copying its first checkpoint into its resumed folder (DGC's latest-r*.pth
    after epoch 0, the CIFAR-100 script's every-rank state after its first epoch); the
    bpslaunch launch runs the same commands there, resuming (the CIFAR-100 script told so by
    --resume-state)."""
    root = tmp_path_factory.mktemp("resume_scripts")
    folders = {name: (root / name / "straight", root / name / "resumed") for name in ("dgc", "cifar100")}
    for name, pair in folders.items():
        for folder in pair:
            folder.mkdir(parents=True)
            if name == "dgc":
                write_cifar10(str(folder / "data"), n_train=32, n_test=8)
            else:
                write_cifar100(str(folder / "data"), n_train=32, n_test=16)  # 2 steps an epoch per rank
    (dgc, dgc_resumed), (cifar, cifar_resumed) = folders["dgc"], folders["cifar100"]
    launch(torchrun_argv, [straight_run(CIFAR100, CIFAR100_ARGV, cifar, ".state:1", cifar_resumed),
                           straight_run(DGC_TRAIN, DGC_ARGV, dgc, "latest-r:1", dgc_resumed)], root)
    resume = ["--resume-state", "params/cifar100-resnet20-0.r{rank}.state"]
    # the CIFAR-100 script first in both launches: DGC's train.py sets BYTEPS_MIN_COMPRESS_BYTES
    # and others in os.environ (setdefault, the seed's settings), which stay for the runs after
    # it in its process (a CIFAR-100 run after it declared 59 gradients more than its checkpoint)
    launch(bpslaunch_argv, [{"script": CIFAR100, "cwd": str(cifar_resumed), "argv": [*CIFAR100_ARGV, *resume]},
                            {"script": DGC_TRAIN, "cwd": str(dgc_resumed), "argv": DGC_ARGV}], root)
    return folders


def same_models(a, b, key="model"):
    """Two checkpoints' models (or state dicts): bit for bit."""
    a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    a, b = (a[key], b[key]) if key else (a, b)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_dgc_train_resumes_with_dgcs_memory(scripts):
    straight, resumed = scripts["dgc"]
    run_dir = f"runs/{DGC_RUN}/checkpoints"
    log = (resumed / "runs" / DGC_RUN / "train.log").read_text()
    assert "[resume_path] = " in log and "DGC's accumulated gradients and momentum (bps_gc's codec state" in log
    for rank in range(2):
        same_models(straight / run_dir / f"latest-r{rank}.pth", resumed / run_dir / f"latest-r{rank}.pth")
        assert "bps_gc" in torch.load(resumed / run_dir / f"latest-r{rank}.pth", weights_only=True)["optimizer"]


def test_cifar100_script_resumes_every_ranks_state(scripts):
    # straight, leaving every rank's state after the first epoch in the other folder; the
    # second epoch again from there
    straight, resumed = scripts["cifar100"]
    same_models(straight / "params" / "cifar100-resnet20-1.params", resumed / "params" / "cifar100-resnet20-1.params",
                key=None)
    for rank in range(2):
        same_models(straight / "params" / f"cifar100-resnet20-1.r{rank}.state",
                    resumed / "params" / f"cifar100-resnet20-1.r{rank}.state")
