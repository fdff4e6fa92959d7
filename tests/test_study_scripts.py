"""example/pytorch/train_cifar10_resnet9.py and train_imagenet_nv.py, the twins of the layer-wise
study's scripts: the study's and DGC's flags map to compression_params (every --method, any
case), bad flags are one line, the seed's ImageNet command line is accepted as written, the
ImageNet folder reader, and short real runs on tiny data under torchrun (torch.distributed),
bpslaunch (parameter server) and bpslaunch --servers 0 (torch.distributed without torchrun's
agent), each method in one of them; the seed's ImageNet command,
started again from its first checkpoints, resumes bit for bit (issue 33, with test_resume_scripts.py)."""
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
from cluster import run_local  # noqa: E402
from collective_cluster import bpslaunch_argv, job_env, runs_job_argv, torchrun_argv  # noqa: E402
from conftest import ROOT, load_script  # noqa: E402
from test_cifar10_choco import write_cifar10  # noqa: E402
from test_resume_scripts import same_models  # noqa: E402

from bps_gc.compress import CompressionParams  # noqa: E402

EXAMPLES = os.path.join(ROOT, "example", "pytorch")
CIFAR = os.path.join(EXAMPLES, "train_cifar10_resnet9.py")
IMAGENET = os.path.join(EXAMPLES, "train_imagenet_nv.py")
# the study's README, training/: the example command after torch.distributed.launch's own flags
SEED_IMAGENET = ("training/train_imagenet_nv.py --logdir LOG_DIR --distributed --init-bn0 --no-bn-wd "
                 "--name RUN_NAME --compress='layerwise' --method='Topk' --ratio=0.3")
TINY_PHASES = "[{'ep': 0, 'sz': 32, 'bs': 2}, {'ep': (0, 1), 'lr': (0.01, 0.02)}]"
TWO_EPOCH_PHASES = "[{'ep': 0, 'sz': 32, 'bs': 2}, {'ep': (0, 2), 'lr': (0.01, 0.02)}]"


cifar, imagenet = load_script(CIFAR), load_script(IMAGENET)
sys.path.insert(0, os.path.dirname(EXAMPLES))
import imagenet_folder  # noqa: E402


def params_of(module, *argv):
    parser = module.build_parser()
    return module.study_compression(parser.parse_args(list(argv)), parser)


@pytest.mark.parametrize("module", [cifar, imagenet], ids=["cifar", "imagenet"])
def test_every_method_maps_to_compression_params(module):
    layerwise = ("--compress", "layerwise")
    assert params_of(module) is None
    assert params_of(module, *layerwise, "--method", "Topk", "--ratio", "0.3") == {"compressor": "topk", "k": 0.3}
    assert params_of(module, *layerwise, "--method", "RANDOMK", "-K", "0.01") == {"compressor": "randomk", "k": 0.01}
    assert params_of(module, *layerwise, "--method", "Thresholdv", "-V", "0.002") == \
        {"compressor": "threshold", "threshold": 0.002}
    assert params_of(module, *layerwise, "--method", "TernGrad") == {"compressor": "terngrad"}
    assert params_of(module, "-c", "LayerWise", "--method", "qsgd") == {"compressor": "qsgd", "levels": 255}
    assert params_of(module, *layerwise, "--method", "QSGD", "-Q", "15") == {"compressor": "qsgd", "levels": 15}
    dgc = params_of(module, "--compressor", "dgc", "--k", "0.001", "--warmup-epochs", "5", "--fp16-values",
                    "--momentum", "0.9", "--nesterov")
    assert dgc == {"compressor": "dgc", "k": 0.001, "warmup_epochs": 5, "fp16_values": True, "momentum": "nesterov"}
    assert params_of(module, "--compressor", "dgc", "--k", "0.01", "--momentum", "0.9") == \
        {"compressor": "dgc", "k": 0.01, "momentum": "plain"}  # DGC's plain momentum correction
    assert params_of(module, "--compress", "entiremodel", "--method", "topk", "--ratio", "0.01") == \
        {"compressor": "topk", "k": 0.01, "granularity": "entiremodel"}
    for method in ("topk", "randomk", "thresholdv", "terngrad", "qsgd"):
        CompressionParams.from_dict(params_of(module, *layerwise, "--method", method))


@pytest.mark.parametrize("argv, message", [
    (["--method", "fastest"], "argument --method: invalid choice: 'fastest'"),
    (["--compress", "layerwise", "--method", "topk", "--ratio", "1"], "--ratio is the kept fraction"),
    (["--compress", "layerwise"], "--compress layerwise needs a --method"),
    (["--method", "topk"], "--method topk needs --compress layerwise or entiremodel"),
    (["--compressor", "dgc", "--method", "topk", "--compress", "layerwise"], "choose one"),
    (["--compressor", "powerful"], "--compressor 'powerful': only dgc here"),
    (["--compressor", "dgc", "--k", "2"], "--k is DGC's kept fraction"),
    (["--compress", "layerwise", "--method", "qsgd", "-Q", "0"], "'levels'"),
    (["--momentum", "1.5"], "--momentum must be in [0, 1)"),
])
def test_bad_flags_are_one_line(argv, message, capsys):
    for module in (cifar, imagenet):
        with pytest.raises(SystemExit) as exit_info:
            module.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_bad_phases_missing_data_and_no_launcher_are_one_line(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        imagenet.main(["--phases", "[{'ep': 0, 'size': 32}]"])
    assert "unknown key 'size'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no ImageNet train folder"):
        imagenet.main([str(tmp_path / "nowhere")])
    for name in ("DMLC_NUM_WORKER", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    data = write_cifar10(str(tmp_path / "cifar"), n_train=10, n_test=2)
    with pytest.raises(SystemExit) as exit_info:  # sys.exit(message): Python prints just the message
        cifar.main(["--data-dir", data])
    assert "start it under torchrun" in str(exit_info.value.code) and "\n" not in str(exit_info.value.code)


def test_the_seed_imagenet_command_is_accepted_as_written():
    words = shlex.split(SEED_IMAGENET)
    parser = imagenet.build_parser()
    args = parser.parse_args(words[1:])
    assert (args.logdir, args.name, args.distributed, args.init_bn0, args.no_bn_wd) == \
        ("LOG_DIR", "RUN_NAME", True, True, True)
    assert imagenet.study_compression(args, parser) == {"compressor": "topk", "k": 0.3}
    assert args.data == "~/data/imagenet"
    assert parser.parse_args(words[1:] + ["--local_rank=1"]).local_rank == 1  # torch.distributed.launch adds it


def test_phases_schedule():
    parser = imagenet.build_parser()
    phases = imagenet.parse_phases("[{'ep': 0, 'sz': 128, 'bs': 64}, {'ep': (0, 4), 'lr': (0.1, 0.5)}, "
                                   "{'ep': 4, 'lr': 0.05}, {'ep': 5, 'sz': 224, 'bs': 32, 'trndir': '-sz/352'}, "
                                   "{'ep': (6, 8), 'lr': (0.04, 0.0), 'mode': 'cos'}]", parser)
    assert imagenet.total_epochs(phases) == 8
    assert imagenet.phase_lr(phases, 0) == pytest.approx(0.1) and imagenet.phase_lr(phases, 2) == pytest.approx(0.3)
    assert imagenet.phase_lr(phases, 4.5) == pytest.approx(0.05)
    assert imagenet.phase_lr(phases, 7) == pytest.approx(0.02)
    assert [imagenet.setting(phases, "sz", e) for e in (0, 4.9, 5)] == [128, 128, 224]
    assert "trndir" in imagenet.notes(parser.parse_args([]), phases)[-1]


def write_imagenet(root, classes=("n01440764", "n01443537"), train=4, val=2, seed=0):
    """A tiny ImageNet tree: root/{train,val}/<wnid>/*.JPEG, random small images."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for split, n in (("train", train), ("val", val)):
        for wnid in classes:
            folder = os.path.join(root, split, wnid)
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                h, w = rng.integers(24, 48, 2)
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(os.path.join(folder, f"{wnid}_{i}.JPEG"))
    return root


def test_imagenet_folder(tmp_path):
    root = write_imagenet(str(tmp_path / "imagenet"))
    classes, items = imagenet_folder.scan(root, "train")
    assert classes == ["n01440764", "n01443537"] and len(items) == 8 and items[-1][1] == 1
    _, val = imagenet_folder.scan(root, "val", classes)
    crop = imagenet_folder.train_image(items[0][0], 16, np.random.default_rng(0))
    assert crop.shape == (3, 16, 16) and crop.dtype == np.uint8
    # C order, so batches are not channels-last (torch's oneDNN backward crashes on those on AVX2)
    assert crop.flags.c_contiguous and imagenet_folder.normalize(np.stack([crop, crop])).flags.c_contiguous
    from PIL import Image
    Image.fromarray(np.arange(40 * 60 * 3, dtype=np.uint8).reshape(40, 60, 3)).save(tmp_path / "x.png")
    center = imagenet_folder.val_image(str(tmp_path / "x.png"), 20)  # 40x60 -> 23x34, middle 20x20
    with Image.open(tmp_path / "x.png") as img:
        expected = np.asarray(img.convert("RGB").resize((34, 23), Image.BILINEAR))[1:21, 7:27]
    assert np.array_equal(center, expected.transpose(2, 0, 1))
    assert center.flags.c_contiguous
    os.makedirs(os.path.join(root, "val", "n99999999"))
    with pytest.raises(SystemExit, match="'n99999999' is not in the training set"):
        imagenet_folder.scan(root, "val", classes)


# ------------------------------------------------------------------------------------ real runs

def launch(launcher, script, argv, timeout=240):
    """``launcher`` "bpslaunch" (one server: the parameter server), "torchrun", or "bpslaunch0"
    (bpslaunch --servers 0: torch.distributed as under torchrun, without its agent, ~1.7 s of CPU)."""
    if launcher == "bpslaunch":
        return run_local([sys.executable, script, *argv], workers=2, servers=1, env={"OMP_NUM_THREADS": "1"},
                         timeout=timeout)
    ranks = (torchrun_argv if launcher == "torchrun" else bpslaunch_argv)([script, *argv], 2)
    return subprocess.run(ranks, env=job_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def launch_runs(launcher, runs, folder):
    """tests/runs_job.py: ``runs`` ({"script", "cwd", "argv", "copy_to"}) one after the other in
    one launch of 2 ranks under ``launcher`` ("torchrun" or "bpslaunch0"): their processes start once."""
    job, runs_json = runs_job_argv(runs, folder)
    return launch(launcher, job, [runs_json], timeout=420)


def summary(result, path):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "Traceback" not in result.stdout + result.stderr
    return json.loads(path.read_text())


# (launcher, network, flags, least compression ratio): with the ImageNet runs below (topk as the
# seed's command, terngrad) every method runs once, and each script under both launchers (and
# torch.distributed under bpslaunch --servers 0 too); the torch.distributed runs are runs of the
# module's two launches (torchrun_launch, collective_launch), each parameter-server run a launch
CIFAR_RUNS = {
    "qsgd": ("torchrun", "alexnet", ["-c", "layerwise", "--method", "QSGD", "-Q", "15"], 5),
    "thresholdv": ("bpslaunch0", "resnet9", ["--compress", "layerwise", "--method", "ThresholdV", "-V", "0.001"], 0.3),
    # epoch 0 of a 2-epoch sparsity warm-up keeps sqrt(0.01) = 10%
    "dgc": ("bpslaunch", "resnet9", ["--compressor", "dgc", "--k", "0.01", "--warmup-epochs", "2", "--fp16-values",
                                     "--momentum", "0.9", "--nesterov"], 3),
    # on torch.distributed (a run of collective_launch, not a parameter-server launch of its own:
    # dgc's keeps the script's parameter-server run; tests/test_torch_granularity.py checks the
    # entire-model arithmetic on both transports)
    "randomk": ("bpslaunch0", "alexnet", ["--compress", "entiremodel", "--method", "RandomK", "--ratio", "0.05"], 6),
}
SHARED_LAUNCH = {"torchrun": "torchrun_launch", "bpslaunch0": "collective_launch"}  # launcher -> its fixture


def cifar_argv(name, folder):
    """CIFAR_RUNS[name]'s command line, its tiny data written in folder/data, its logs in folder/logs."""
    _, network, flags, _ = CIFAR_RUNS[name]
    data = write_cifar10(str(folder / "data"), n_train=40, n_test=8)
    return ["--data-dir", data, "-n", network, "--width", "4", "--epochs", "1", "--batch-size", "4",
            "--max-iters", "2", "-j", "0", "--logdir", str(folder / "logs"), "--name", name, *flags]


def cifar_runs(launcher, tmp_path_factory):
    """{name: folder} of CIFAR_RUNS's runs under ``launcher``, and their runs for runs_job.py."""
    folders = {name: tmp_path_factory.mktemp(name) for name, run in sorted(CIFAR_RUNS.items()) if run[0] == launcher}
    return folders, [{"script": CIFAR, "cwd": str(folder), "argv": cifar_argv(name, folder)}
                     for name, folder in folders.items()]


@pytest.mark.parametrize("name", sorted(CIFAR_RUNS))
def test_cifar10_script_runs(name, tmp_path, request):
    launcher, _, flags, least_ratio = CIFAR_RUNS[name]
    if launcher in SHARED_LAUNCH:
        tmp_path, result = request.getfixturevalue(SHARED_LAUNCH[launcher])[name]
    else:
        result = launch(launcher, CIFAR, cifar_argv(name, tmp_path))
    result = summary(result, tmp_path / "logs" / f"{name}.json")
    assert result["workers"] == 2 and result["transport"] == ("ps" if launcher == "bpslaunch" else "collective")
    assert result["compression_params"] == params_of(cifar, *flags)
    [row] = result["history"]
    assert row["steps"] == 2 and 0 <= row["val_accuracy"] <= 1 and np.isfinite(row["train_loss"])
    assert row["ratio"] >= least_ratio, row
    log = (tmp_path / "logs" / f"{name}.log").read_text()
    assert "validation: accuracy=" in log and "compression ratio" in log
    # the study trains on CUDA (--device cuda by default): on this CPU box a note, then the CPU
    assert "note: cuda asked for, but this host has no CUDA device: training on the CPU" in log
    assert "device: cpu (asked: cuda)" in log


def seed_imagenet_argv(folder):
    """The seed's ImageNet command, with the data, a tiny model, two epochs and a checkpoint
    folder after it, everything under ``folder`` (the data written there)."""
    data = write_imagenet(str(folder / "imagenet"))
    argv = shlex.split(SEED_IMAGENET.replace("LOG_DIR", str(folder / "logs")))[1:]
    return argv + [data, "--arch", "resnet18", "--width", "4", "--phases", TWO_EPOCH_PHASES, "--short-epoch",
                   "--checkpoint", str(folder / "ckpt")]


@pytest.fixture(scope="module")
def torchrun_launch(tmp_path_factory):
    """One launch under torchrun (tests/runs_job.py: its 2 ranks start once): first the seed's
    ImageNet command (seed_imagenet_argv), checked by test_imagenet_script_runs[torchrun], and the
    straight run the resumed one must equal; it copies its first checkpoints (after epoch 0) into
    resume folder/ckpt as it writes them (tests/interrupted_run.py's COPY_TO), where the resumed
    run starts: what a run interrupted right after them leaves, without a launch for it; then
    CIFAR_RUNS's torchrun runs. {"seed": (folder, result, resume folder), name: (folder, result)}."""
    folder, resume = tmp_path_factory.mktemp("seed_imagenet"), tmp_path_factory.mktemp("seed_imagenet_resumed")
    folders, runs = cifar_runs("torchrun", tmp_path_factory)
    seed = {"script": IMAGENET, "cwd": str(folder), "argv": seed_imagenet_argv(folder), "copy_to": str(resume)}
    result = launch_runs("torchrun", [seed, *runs], tmp_path_factory.mktemp("torchrun"))
    return {"seed": (folder, result, resume), **{name: (path, result) for name, path in folders.items()}}


@pytest.fixture(scope="module")
def collective_launch(torchrun_launch, tmp_path_factory):
    """One launch under bpslaunch --servers 0 (runs_job.py): first the seed's ImageNet command
    again, started in the resume folder of torchrun_launch (it resumes there), then CIFAR_RUNS's
    bpslaunch0 runs.
    {"resumed": (what resume folder/ckpt held before it, result), name: (folder, result)}."""
    _, _, resume = torchrun_launch["seed"]
    held = sorted(os.listdir(resume / "ckpt")) if os.path.isdir(resume / "ckpt") else None
    folders, runs = cifar_runs("bpslaunch0", tmp_path_factory)
    resumed = {"script": IMAGENET, "cwd": str(resume), "argv": seed_imagenet_argv(resume)}
    result = launch_runs("bpslaunch0", [resumed, *runs], tmp_path_factory.mktemp("collective"))
    return {"resumed": (held, result), **{name: (path, result) for name, path in folders.items()}}


@pytest.mark.parametrize("launcher", ["torchrun", "bpslaunch"])
def test_imagenet_script_runs(launcher, tmp_path, request):
    """torchrun: the seed's command as written, with the data and a tiny model, two epochs and a
    checkpoint folder after it; bpslaunch: terngrad on the parameter server, one epoch."""
    if launcher == "torchrun":
        folder, result, _ = request.getfixturevalue("torchrun_launch")["seed"]
        logdir, name, epochs = folder / "logs", "RUN_NAME", 2
    else:
        data = write_imagenet(str(tmp_path / "imagenet"))
        logdir, name, epochs = tmp_path / "logs", "tern", 1
        argv = ["--logdir", str(logdir), "--name", "tern", "--compress", "layerwise", "--method", "TernGrad",
                "-j", "2", "--fp16", data, "--arch", "resnet18", "--width", "4", "--phases", TINY_PHASES,
                "--short-epoch"]
        result = launch(launcher, IMAGENET, argv)
    result = summary(result, logdir / f"{name}.json")
    rows = result["history"]
    assert len(rows) == epochs, rows
    assert all(row["steps"] == 2 and np.isfinite(row["train_loss"]) for row in rows), rows
    log = (logdir / f"{name}.log").read_text()
    assert "resnet18 (width 4), 2 classes, 8 training and 4 validation images" in log
    if launcher == "torchrun":
        assert result["compression_params"] == {"compressor": "topk", "k": 0.3}
        assert all(row["ratio"] > 1.2 for row in rows), rows
    else:
        # --fp16: autocast float16 and a gradient scaler (on the CPU here), float16 on the wire
        assert "precision: mixed precision: autocast float16 on cpu, gradient scaler" in log
        assert "note: --distributed not given" in log and "device: cpu (asked: cuda)" in log
        assert result["compression_params"] == {"compressor": "terngrad", "fp16": True} and rows[0]["ratio"] > 4


def test_study_imagenet_script_resumes_from_its_checkpoint_folder(torchrun_launch, collective_launch):
    """Issue 33 (with test_resume_scripts.py's other scripts): the seed's ImageNet command,
    started in a folder holding only the straight run's first checkpoints (copied as written),
    resumes and ends with the straight run's parameters on every rank, bit for bit."""
    straight, _, tmp_path = torchrun_launch["seed"]
    held, result = collective_launch["resumed"]
    assert held == ["rank0.pth", "rank1.pth"]  # the copies, nothing else
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    log = (tmp_path / "logs" / "RUN_NAME.log").read_text()
    assert f"resumed from {tmp_path / 'ckpt'} after epoch 0" in log
    for rank in range(2):
        same_models(straight / "ckpt" / f"rank{rank}.pth", tmp_path / "ckpt" / f"rank{rank}.pth")
