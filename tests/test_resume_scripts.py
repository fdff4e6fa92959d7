"""Issue 33: the seeds' PyTorch scripts resume with their codec state. Each runs twice on 2
gloo ranks at a tiny size: straight, which copies its first checkpoint into another folder as
it writes it (tests/interrupted_run.py's COPY_TO: what a run interrupted right after that
checkpoint leaves, without a launch for it), then the same command in that folder, resuming.
The launches are bpslaunch --servers 0 (torch.distributed as under torchrun, without
torchrun's agent: ~1.2 s of CPU a launch) but for the CIFAR-100 script's straight run, its one
run under torchrun (DGC's train.py runs under torchrun in test_dgc_train.py). The scripts are
deterministic: both end with the same parameters on every rank, bit for bit (without the codec
state they would not: test_restart_state.py). CHOCO's and local SGD's script resume in
test_cifar10_choco.py, from its torchrun runs, the study's ImageNet script in
test_study_scripts.py, from its run of the seed's command."""
import os
import subprocess
import sys

import pytest

from collective_cluster import bpslaunch_argv, job_env, torchrun_argv
from conftest import ROOT
from test_cifar10_choco import write_cifar10
from test_pytorch_examples import write_cifar100

torch = pytest.importorskip("torch")
EXAMPLES = os.path.join(ROOT, "example", "pytorch")
INTERRUPT = os.path.join(ROOT, "tests", "interrupted_run.py")


def run(script, argv, cwd, interrupt=None, launcher=bpslaunch_argv, copy_to=None):
    """``interrupt``: interrupted_run.py's INTERRUPT_AFTER (the run ends right after that
    checkpoint), or with ``copy_to`` the run goes on and copies that checkpoint there."""
    command = [INTERRUPT, script, *argv] if interrupt else [script, *argv]
    env = job_env({"INTERRUPT_AFTER": interrupt, **({"COPY_TO": str(copy_to)} if copy_to else {})} if interrupt else {})
    env = {k: v for k, v in env.items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL"))}
    result = subprocess.run(launcher(command, 2), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def straight_and_resumed(tmp_path, script, argv, interrupt, data=None):
    """(straight run's folder, resumed run's folder): ``argv`` run straight in the first, which
    copies its checkpoint ``interrupt`` (INTERRUPT_AFTER's MARKER:COUNT) into the second as it
    writes it, then run in the second, resuming from it; ``data(folder)`` writes the data set
    in each first."""
    folders = [tmp_path / "straight", tmp_path / "resumed"]
    for folder in folders:
        folder.mkdir()
        if data:
            data(folder)
    run(script, argv, folders[0], interrupt, copy_to=folders[1])
    run(script, argv, folders[1])
    return folders


def same_models(a, b, key="model"):
    """Two checkpoints' models (or state dicts): bit for bit."""
    a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    a, b = (a[key], b[key]) if key else (a, b)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_dgc_train_resumes_with_dgcs_memory(tmp_path):
    argv = ["--configs", "configs/cifar/resnet20.py", "configs/dgc/wm5.py", "--configs.dataset.root", "data",
            "--configs.train.batch_size", "8", "--configs.data.num_threads_per_worker", "0",
            "--configs.train.num_epochs", "2"]
    straight, resumed = straight_and_resumed(tmp_path, os.path.join(EXAMPLES, "dgc", "train.py"), argv, "latest-r:1",
                                             lambda folder: write_cifar10(str(folder / "data"), n_train=32, n_test=8))
    run_dir = "runs/[cifar.resnet20+dgc.wm5].np2/checkpoints"
    log = (resumed / "runs" / "[cifar.resnet20+dgc.wm5].np2" / "train.log").read_text()
    assert "[resume_path] = " in log and "DGC's accumulated gradients and momentum (bps_gc's codec state" in log
    for rank in range(2):
        same_models(straight / run_dir / f"latest-r{rank}.pth", resumed / run_dir / f"latest-r{rank}.pth")
        assert "bps_gc" in torch.load(resumed / run_dir / f"latest-r{rank}.pth", weights_only=True)["optimizer"]


def test_cifar100_script_resumes_every_ranks_state(tmp_path):
    script = os.path.join(EXAMPLES, "train_cifar100_byteps_gc.py")
    common = ["--data-dir", "data", "--batch-size", "8", "-j", "0", "--save-dir", "params", "--save-period", "1",
              "--num-epochs", "2", "--compressor", "topk", "--k", "0.05", "--ef", "vanilla"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for folder in (straight, resumed):
        folder.mkdir()
        write_cifar100(str(folder / "data"), n_train=32, n_test=16)  # 2 steps an epoch per rank
    # straight, leaving every rank's state after the first epoch in the other folder; the
    # second epoch again from there
    run(script, common, straight, interrupt=".state:1", launcher=torchrun_argv, copy_to=resumed)
    run(script, [*common, "--resume-state", "params/cifar100-resnet20-0.r{rank}.state"], resumed)
    same_models(straight / "params" / "cifar100-resnet20-1.params", resumed / "params" / "cifar100-resnet20-1.params",
                key=None)
    for rank in range(2):
        same_models(straight / "params" / f"cifar100-resnet20-1.r{rank}.state",
                    resumed / "params" / f"cifar100-resnet20-1.r{rank}.state")
