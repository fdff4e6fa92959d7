"""example/pytorch/dgc/train.py, DGC's way of running: the config files and overrides of DGC's
README resolve as its text says (--dry-run), bad settings are one line (both through train.py's
main in the pytest process: nothing to launch), and real runs on tiny CIFAR-10 (official python
files) and ImageNet (class folders) train, log per-epoch accuracy, checkpoint per worker and
resume, under bpslaunch (one launcher per role, as across machines, parameter server), torchrun
(the collective: the ImageNet run and the CIFAR run's resumption, in one launch) and bpslaunch
--servers 0 (the ImageNet run's --evaluate).

The traffic oracle: DGC sends ceil(n*r) (float16 value, uint32 index) records = 6 bytes each for
every tensor of more than one dimension (at least 0.8 of them when the adaptation stops early:
algorithms.md 2.3) and the 1-D tensors dense, 4 bytes an element; r is the warm-up list's entry
for the epoch. Computed here from the model's shapes."""
import contextlib
import functools
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from collective_cluster import runs_job_argv
from conftest import LAUNCH_PYTHONPATH, ROOT, load_script
from multihost import Job
from test_cifar10_choco import write_cifar10
from test_study_scripts import write_imagenet

pytest.importorskip("torch")
TRAIN = os.path.join(ROOT, "example", "pytorch", "dgc", "train.py")
WM5 = [0.25, 0.063, 0.015, 0.004, 0.001]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": LAUNCH_PYTHONPATH, "BPS_GC_HEARTBEAT_INTERVAL": "0.2",
       "BPS_GC_HEARTBEAT_TIMEOUT": "5"}

# DGC's README (../shared/seeds/004_*.txt), the flags after `python train.py` as printed
SEED_CIFAR = "--configs configs/cifar/resnet20.py configs/dgc/wm5.py configs/dgc/fp16.py configs/dgc/int32.py"
SEED_IMAGENET = "--configs configs/imagenet/resnet50.py configs/dgc/wm0.py"
SEED_E500 = "--configs configs/cifar/resnet20.py configs/dgc/wm5.py --configs.train.num_epochs 500 --suffix .e500"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(("DMLC_", "BYTEPS_", "BPS_GC_")) or k == "BPS_GC_CENSUS")  # the census's, not a setting
           and k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return dict(env, **ENV, **extra)


@functools.lru_cache(maxsize=None)
def train_main():
    """train.py's main, loaded into this process once (a dry run or a refused setting launches
    nothing: no process needed); the folders it puts first on sys.path taken off again."""
    path = list(sys.path)
    try:
        module = load_script(TRAIN, "dgc_train")
    finally:
        sys.path[:] = path
    return module.main


@contextlib.contextmanager
def in_process(cwd):
    """train_main() to call as a process of its own would run: in ``cwd``, in clean_env() (this
    process's environment put back after)."""
    saved, env = dict(os.environ), clean_env()
    os.environ.clear()
    os.environ.update(env)
    try:
        with contextlib.chdir(cwd):
            yield train_main()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def dry_run(argv, cwd):
    """The settings train.py --dry-run prints (its last line, JSON), from its main (in_process)."""
    out = io.StringIO()
    with in_process(cwd) as main, contextlib.redirect_stdout(out):
        assert main([*argv, "--dry-run"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_the_readme_commands_resolve_as_described(tmp_path):
    c = dry_run(SEED_CIFAR.split(), tmp_path)  # "fp16 values, int32 indices; warmup coeff [...] -> 0.001"
    comp = c["train"]["compression"]
    assert (c["dataset"]["name"], c["model"]["name"], c["train"]["num_epochs"]) == ("cifar10", "resnet20", 200)
    assert comp["warmup_epochs"] == 5 and comp["warmup_coeff"] == WM5 and comp["compress_ratio"] == 0.001
    assert comp["fp16_values"] is True and comp["int32_indices"] is True
    assert c["train"]["save_path"] == "runs/[cifar.resnet20+dgc.[wm5+fp16+int32]].np1"
    assert c["bps_gc"]["compression_params"] == {
        "compressor": "dgc", "k": 0.001, "sample_ratio": 0.01, "momentum_masking": True, "warmup_densities": WM5,
        "fp16_values": True, "momentum": "plain"}  # the CIFAR configs' memory.nesterov = False
    assert c["bps_gc"]["wire"] == {"value_bytes": 2, "index_bytes": 4, "dgc_index_bytes": 4}

    c = dry_run(SEED_IMAGENET.split(), tmp_path)  # "fp32 values, int64 indices, no warmup"
    comp = c["train"]["compression"]
    assert (c["dataset"]["name"], c["model"]["name"], c["model"]["num_classes"]) == ("imagenet", "resnet50", 1000)
    assert comp["warmup_epochs"] == 0 and comp["fp16_values"] is False and comp["int32_indices"] is False
    assert "warmup_densities" not in c["bps_gc"]["compression_params"]
    assert "fp16_values" not in c["bps_gc"]["compression_params"]
    assert c["bps_gc"]["wire"] == {"value_bytes": 4, "index_bytes": 4, "dgc_index_bytes": 8}
    assert any("int64" in note for note in c["bps_gc"]["notes"])
    assert c["train"]["optimizer"]["nesterov"] is True
    assert c["bps_gc"]["compression_params"]["momentum"] == "nesterov"
    assert c["train"]["save_path"] == "runs/[imagenet.resnet50+dgc.wm0].np1"

    c = dry_run(SEED_E500.split(), tmp_path)
    assert c["train"]["num_epochs"] == 500 and c["train"]["compression"]["warmup_coeff"] == WM5
    assert c["train"]["compression"]["fp16_values"] is False
    assert c["train"]["save_path"] == "runs/[cifar.resnet20+dgc.wm5].e500.np1"


def test_device_flags_resolve():
    """DGC's --devices gpu|cpu, --device, configs.device (default auto), and mixed precision
    (bps_gc's setting: DGC's fp16.py is float16 values on the wire, float32 training)."""
    assert dry_run(SEED_CIFAR.split(), ROOT)["device"] == "auto"
    assert dry_run(SEED_CIFAR.split() + ["--devices", "gpu"], ROOT)["device"] == "cuda"
    assert dry_run(SEED_CIFAR.split() + ["--devices", "cpu"], ROOT)["device"] == "cpu"
    assert dry_run(SEED_CIFAR.split() + ["--devices", "gpu", "--device", "cuda:1"], ROOT)["device"] == "cuda:1"
    assert dry_run(SEED_CIFAR.split() + ["--configs.device", "GPU"], ROOT)["device"] == "cuda"
    c = dry_run(SEED_CIFAR.split() + ["--configs.train.mixed_precision", "bfloat16"], ROOT)
    assert c["train"]["mixed_precision"] == "bfloat16"
    assert dry_run(SEED_CIFAR.split(), ROOT)["train"]["mixed_precision"] is None


def test_dgc_without_a_list_warms_up_as_dgc_code_and_overrides_are_typed(tmp_path):
    c = dry_run(["--configs", "configs/cifar/resnet110.py", "configs/dgc/wm0.py",
                 "--configs.train.compression.warmup_epochs", "3", "--configs.train.optimizer.lr=1",
                 "--configs.train.compression.memory.gradient_clipping", "2"], tmp_path)
    assert c["model"]["name"] == "resnet110" and c["train"]["optimizer"]["lr"] == 1.0
    assert isinstance(c["train"]["optimizer"]["lr"], float)
    params = c["bps_gc"]["compression_params"]
    assert params["warmup_densities"] == pytest.approx([0.001 ** ((e + 1) / 4) for e in range(3)])
    assert params["clip_norm"] == 2.0


@pytest.mark.parametrize("argv, message", [
    (["--configs", "configs/cifar/resnet20.py", "--configs.train.num_epoch", "5"], "num_epoch: no such setting"),
    (["--configs", "configs/cifar/resnet20.py", "--configs.train.num_epochs", "many"], "want a number"),
    (["--configs", "configs/cifar/nope.py"], "config file 'configs/cifar/nope.py' not found"),
    (["--configs", "configs/dgc/wm5.py"], "configs.dataset.name must be one of"),
    (["--configs", "configs/cifar/resnet20.py", "configs/dgc/wm5.py",
      "--configs.train.compression.compress_ratio", "2"], "compress_ratio is the kept fraction"),
    (["--configs", "configs/cifar/resnet20.py", "configs/dgc/wm5.py",
      "--configs.train.compression.max_adaptation_iters", "3"], "implements 10 only"),
    (["--configs", "configs/cifar/resnet20.py", "--configs.device", "tpu"], "configs.device: want auto, cpu, cuda"),
    (["--configs", "configs/cifar/resnet20.py", "--device", "tpu"], "argument --device: want auto, cpu, cuda"),
    (["--configs", "configs/cifar/resnet20.py", "--configs.train.mixed_precision", "int8"],
     "configs.train.mixed_precision: None, float16 or bfloat16"),
])
def test_bad_settings_are_one_line(argv, message, tmp_path, capsys):
    with in_process(tmp_path) as main, pytest.raises(SystemExit) as stopped:
        main([*argv, "--dry-run"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_cifar_names_the_flag_that_sets_it(tmp_path):
    """The data folder comes from --configs.dataset.root (the seed's flag), and the error says so."""
    argv = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", "1", "--servers", "0", "--",
            sys.executable, TRAIN, "--configs", "configs/cifar/resnet20.py", "--configs.dataset.root", "nowhere"]
    result = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert ("no CIFAR-10 train file at nowhere/cifar-10-batches-py/data_batch_1 (want the python version, "
            "cifar-10-python.tar.gz, unpacked in --configs.dataset.root; nothing is downloaded)") in result.stderr, \
        result.stderr[-2000:]
    assert "--data_dir" not in result.stderr and "Traceback" not in result.stderr


def record_bounds(model, density, value_bytes=2):
    """(least, most) bytes a worker pushes per step at ``density`` (the module docstring)."""
    most = least = 0
    for p in model.parameters():
        if p.dim() > 1:
            selects = math.ceil(p.numel() * density)
            most += selects * (value_bytes + 4)
            least += math.ceil(0.8 * selects) * (value_bytes + 4)
        else:
            most += 4 * p.numel()
            least += 4 * p.numel()
    return least, most


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


TINY_CIFAR = ["--configs.dataset.root", "data", "--configs.train.batch_size", "8",
              "--configs.data.num_threads_per_worker", "0"]


CIFAR_RUN = "[cifar.resnet20+dgc.[wm5+fp16+int32]].np2"
IMAGENET_RUN = "[imagenet.resnet50+dgc.wm0].tiny.np2"
# the seed's ImageNet command at a tiny size, its data in imagenet/ (torchrun_launch writes it: 2
# classes, 8 training and 4 validation images)
TINY_IMAGENET = [*SEED_IMAGENET.split(), "--configs.dataset.root", "imagenet", "--configs.dataset.image_size", "32",
                 "--configs.model.width", "4", "--configs.model.num_classes", "2", "--configs.train.batch_size", "2",
                 "--configs.train.num_epochs", "1", "--configs.data.num_threads_per_worker", "0", "--suffix", ".tiny"]


def cifar_on_the_parameter_server(folder):
    """The seed's CIFAR command, one epoch on the parameter server, one bpslaunch per role
    (scheduler, server, 2 workers), as on separate machines, in ``folder`` (its data written
    there: 80 images / 2 workers / 8 = 5 steps); what the job left: (its roles' statuses, its
    report, the run's metrics rows, its log, the files in its checkpoint folder)."""
    write_cifar10(str(folder / "data"), n_train=80, n_test=24)
    argv = [*SEED_CIFAR.split(), *TINY_CIFAR, "--configs.train.num_epochs", "1"]
    script = (f"import os, runpy, sys; os.chdir({str(folder)!r}); sys.argv = [{TRAIN!r}] + {argv!r}; "
              f"runpy.run_path({TRAIN!r}, run_name='__main__')")
    slow_ok = {"BPS_GC_HEARTBEAT_TIMEOUT": "10"}  # a shared 2-core machine may stall a process for seconds
    job = Job(2, script, servers=1, env={"OMP_NUM_THREADS": "1"},
              role_env={name: slow_ok for name in ("scheduler", "server0", "worker0", "worker1")})
    statuses, _ = job.wait_all(150)
    run_dir = folder / "runs" / CIFAR_RUN
    left = [rows(run_dir) if (run_dir / "metrics.jsonl").is_file() else [],
            (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else "",
            sorted(f for f in os.listdir(run_dir / "checkpoints") if (run_dir / "checkpoints" / f).is_file())
            if (run_dir / "checkpoints").is_dir() else []]
    return (statuses, job.report(statuses), *left)


@pytest.fixture(scope="module")
def torchrun_launch(tmp_path_factory):
    """One launch under torchrun (tests/runs_job.py: its 2 ranks start once) of train.py twice:
    first the ImageNet command (TINY_IMAGENET), one epoch (its checkpoint is what
    test_imagenet_resnet50_one_epoch_under_torchrun's --evaluate run loads, in a process of its
    own: runs_job.py), then the CIFAR command with 2 epochs, in the folder where
    it ran its first epoch on the parameter server (cifar_on_the_parameter_server, run here
    first), resuming at epoch 1; the parameter server's codec state does not apply on
    torch.distributed, dropped as asked. {"imagenet": folder, "cifar": (folder, what its first
    epoch left), "result": the launch's result}."""
    imagenet, cifar = tmp_path_factory.mktemp("imagenet"), tmp_path_factory.mktemp("cifar")
    first_epoch = cifar_on_the_parameter_server(cifar)
    write_imagenet(str(imagenet / "imagenet"), train=4, val=2)
    runs = [{"script": TRAIN, "cwd": str(imagenet), "argv": TINY_IMAGENET},
            {"script": TRAIN, "cwd": str(cifar), "argv": [*SEED_CIFAR.split(), *TINY_CIFAR,
                                                          "--configs.train.num_epochs", "2"],
             "env": {"BPS_GC_RESUME_DROP_RANK_STATE": "1"}}]
    folder = tmp_path_factory.mktemp("torchrun")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             *runs_job_argv(runs, folder)], cwd=folder, env=clean_env(), capture_output=True,
                            text=True, timeout=300)
    return {"imagenet": imagenet, "cifar": (cifar, first_epoch), "result": result}


def test_cifar_one_epoch_on_the_parameter_server_then_resumed_on_the_collective(torchrun_launch):
    """One epoch on the parameter server, then the same command with 2 epochs resumes at epoch
    1 (density 6.3%) on the collective: a run of torchrun_launch."""
    tmp_path, (statuses, report, first_rows, log, saved) = torchrun_launch["cifar"]
    assert set(statuses.values()) == {0}, report
    run_dir = tmp_path / "runs" / CIFAR_RUN
    [row] = first_rows
    sys.path.insert(0, os.path.join(ROOT, "example", "pytorch"))
    from train_cifar100_byteps_gc import resnet
    model = resnet("resnet20", 10)
    least, most = record_bounds(model, WM5[0])
    assert row["epoch"] == 0 and row["steps"] == 5 and least <= row["pushed_bytes_per_step"] <= most, row
    assert 0 <= row["acc/test_top1"] <= row["acc/test_top5"] <= 100
    assert row["acc/test_top1"] * 24 / 100 == pytest.approx(round(row["acc/test_top1"] * 24 / 100))
    assert "[acc/test_top1] = " in log and "(ps)" in log and "==> train from scratch" in log
    assert "device: cpu (asked: auto)" in log and "precision: float32" in log
    for rank in (0, 1):
        assert f"latest-r{rank}.pth" in saved and f"e0-r{rank}.pth" in saved, saved

    # the resumed run: the parameter server's codec state does not apply on torch.distributed, dropped as asked
    result = torchrun_launch["result"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "saved on the parameter server, here torch.distributed" in result.stdout + result.stderr
    first, second = rows(run_dir)
    assert first == row and second["epoch"] == 1 and second["steps"] == 5
    least, most = record_bounds(model, WM5[1])
    assert least <= second["pushed_bytes_per_step"] <= most, second
    log = (run_dir / "train.log").read_text()
    assert "[resume_path] = " in log and "(collective)" in log and "==> training epoch 1/2" in log
    assert "==> training epoch 0/2" not in log


def test_imagenet_resnet50_one_epoch_under_torchrun(torchrun_launch):
    """One epoch under torchrun (a run of torchrun_launch), then --evaluate under bpslaunch
    --servers 0 (torch.distributed too, without torchrun's agent)."""
    tmp_path, result = torchrun_launch["imagenet"], torchrun_launch["result"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / IMAGENET_RUN
    [row] = rows(run_dir)
    assert row["steps"] == 2 and row["acc/test_top5"] == 100.0  # top-5 of 2 classes
    sys.path.insert(0, os.path.join(ROOT, "example", "pytorch"))
    from imagenet_resnet import ResNet
    least, most = record_bounds(ResNet("resnet50", 2, 4), 0.001, value_bytes=4)  # fp32 values, no warm-up
    assert least <= row["pushed_bytes_per_step"] <= most, row
    log = (run_dir / "train.log").read_text()
    assert "note: int32_indices False" in log and "note: optimize_bn_separately" in log
    # --evaluate: every worker runs rank 0's best checkpoint (broadcast, BatchNorm statistics
    # included, as DGC's code does); its top-1 over the 4 validation images, computed here
    evaluated = subprocess.run([sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", "2", "--servers",
                                "0", "--", sys.executable, TRAIN, *TINY_IMAGENET, "--evaluate"],
                               cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=150)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    out = evaluated.stdout
    import torch
    import imagenet_folder
    model = ResNet("resnet50", 2, 4, True)
    model.load_state_dict(torch.load(run_dir / "checkpoints" / "best-r0.pth", weights_only=True)["model"])
    model.eval()
    _, items = imagenet_folder.scan(str(tmp_path / "imagenet"), "val", ["n01440764", "n01443537"])
    x = imagenet_folder.normalize(np.stack([imagenet_folder.val_image(path, 32) for path, _ in items]))
    with torch.no_grad():
        correct = int((model(torch.from_numpy(x)).argmax(1).numpy() == [label for _, label in items]).sum())
    assert f"[acc/test_top1] = {100 * correct / 4:f}" in out and "best-r0.pth" in out, out[-2000:]
    assert len(rows(run_dir)) == 1


def test_learning_rate_and_run_names(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "example", "pytorch"))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "example", "pytorch", "dgc"))
    import dgc_config
    import dgc_training
    dgc_config.reset()
    c = dgc_config.load(["configs/cifar/resnet20.py"], search=[os.path.dirname(TRAIN)])
    # 4 workers: from 0.1 linearly (per step) to 0.4 over 5 epochs, then a per-epoch cosine over 195 epochs
    assert dgc_training.learning_rate(c, 0, 0, 10, 4) == pytest.approx(0.1)
    assert dgc_training.learning_rate(c, 2, 5, 10, 4) == pytest.approx(0.1 + 0.3 * 2.5 / 5)
    assert dgc_training.learning_rate(c, 5, 0, 10, 4) == pytest.approx(0.4)
    assert dgc_training.learning_rate(c, 102, 7, 10, 4) == pytest.approx(0.2 * (1 + math.cos(math.pi * 97 / 195)))
    assert dgc_training.learning_rate(c, 199, 9, 10, 4) == pytest.approx(0.2 * (1 + math.cos(math.pi * 194 / 195)))
    assert dgc_config.run_name(["configs/cifar/resnet110.py"]) == "cifar.resnet110"
    assert dgc_config.run_name(["a/configs/imagenet/resnet50.py", "configs/dgc/wm0.py", "configs/dgc/fp16.py"]) == \
        "[imagenet.resnet50+dgc.[wm0+fp16]]"
