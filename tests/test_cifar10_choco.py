"""example/pytorch/train_cifar10_choco.py: every seed flag is accepted and explained (--help),
--compress_ratio is translated, and tiny runs on a tiny CIFAR-10 in the official python format
train with each optimizer: local_sgd and parallel_choco under bpslaunch --local (2 workers, one
server) and under torchrun (in one launch; those two checkpoint every epoch and are the straight
runs that a resumed run must equal, issue 33), sgd, post_local_sgd and dpsgd on
torch.distributed in the resumed runs' launch (bpslaunch --servers 0)."""
import json
import os
import pickle
import shlex
import subprocess
import sys

import numpy as np
import pytest

from collective_cluster import runs_job_argv
from conftest import LAUNCH_PYTHONPATH, ROOT

torch = pytest.importorskip("torch")
SCRIPT = os.path.join(ROOT, "example", "pytorch", "train_cifar10_choco.py")
SEED_FLAGS = [
    "--optimizer", "--local_step", "--turn_on_local_step_from", "--graph_topology", "--comm_op",
    "--compress_ratio", "--quantize_level", "--is_biased", "--choco_consenus_stepsize",
    "--choco_consensus_stepsize", "--lr_scaleup", "--lr_scaleup_factor", "--lr_warmup", "--lr_warmup_epochs",
    "--lr_schedule_scheme", "--lr_change_epochs", "--lr_decay", "--weight_decay", "--use_nesterov",
    "--momentum_factor", "--batch_size", "--num_epochs", "--eval_freq", "--avg_model", "--evaluate_avg",
    "--reshuffle_per_epoch", "--hostfile", "--mpi_path", "--world", "--n_mpi_process", "--n_sub_process",
    "--python_path", "--use_ipc", "--comm_device", "--on_cuda", "--arch", "--data", "--pin_memory",
    "--base_batch_size", "--num_workers", "--partition_data", "--stop_criteria", "--track_time",
    "--display_tracked_time", "--experiment", "--consensus_stepsize", "--lr_scheduler", "--lr_milestones",
    "--manual_seed"]


def write_cifar10(data_dir, n_train=80, n_test=24, seed=0):
    """A tiny CIFAR-10 in the official format: data_dir/cifar-10-batches-py/{data_batch_1..5,test_batch}."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(data_dir, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    files = [(f"data_batch_{i}", n_train // 5) for i in range(1, 6)] + [("test_batch", n_test)]
    for name, n in files:
        labels = rng.integers(0, 10, n)
        data = {b"batch_label": name.encode(), b"labels": labels.tolist(),
                b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                b"filenames": [f"img{i}.png".encode() for i in range(n)]}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(data, f, protocol=2)
    return data_dir


def launch(argv, cwd, workers=2, timeout=240, launcher="bpslaunch", command=None):
    """The script with ``argv`` on ``workers`` ranks, or ``command`` (a worker's command after
    the interpreter: tests/runs_job.py's); ``launcher`` "bpslaunch" (one server),
    "torchrun" or "collective" (bpslaunch --servers 0: torch.distributed as under torchrun,
    without torchrun's agent, ~1.2 s of CPU a launch)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=LAUNCH_PYTHONPATH, BPS_GC_HEARTBEAT_INTERVAL="0.2",
               BPS_GC_HEARTBEAT_TIMEOUT="5", BYTEPS_MIN_COMPRESS_BYTES="4096")
    for name in list(env):
        if name.startswith(("DMLC_", "BYTEPS_LOCAL", "BPS_GC_PORT")):
            del env[name]
    command = command or [SCRIPT, *argv]
    if launcher == "torchrun":  # bps_gc.init() then runs on torch.distributed
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
               *command]
    else:
        cmd = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", str(workers), "--servers",
               "0" if launcher == "collective" else "1", "--", sys.executable, *command]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def launch_runs(runs, folder, launcher):
    """tests/runs_job.py: the script's ``runs`` ({"cwd", "argv", "copy_to"}) one after the
    other in one launch of 2 ranks (their processes start once)."""
    return launch(None, folder, timeout=480, launcher=launcher, command=runs_job_argv(runs, folder))


def test_help_lists_every_seed_flag_and_the_ratio_translation():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for flag in SEED_FLAGS:
        assert flag in text, flag
    assert "fraction of each tensor DROPPED" in text and "k = 1 - compress_ratio" in text
    for flag in ("--hostfile", "--mpi_path", "--python_path", "--use_ipc", "--on_cuda", "--comm_device"):
        i = text.index(flag + " ")
        assert len(text[i:i + 200].split()) > 3, f"{flag} is not explained"


def test_reads_the_official_cifar10_files(tmp_path):
    sys.path.insert(0, os.path.dirname(os.path.dirname(SCRIPT)))
    import cifar10_data
    write_cifar10(str(tmp_path), n_train=20, n_test=4)
    images, labels = cifar10_data.load_split(str(tmp_path), "train")
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_2", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert images.shape == (20, 3, 32, 32) and labels.shape == (20,)
    # the five batches in order; rows are 1024 red, 1024 green, 1024 blue values, row-major 32 x 32
    assert np.array_equal(images[4 + 1, 2, 3, 7], raw[b"data"][1, 2048 + 3 * 32 + 7])
    assert labels[4:8].tolist() == raw[b"labels"]
    same = cifar10_data.load_split(str(tmp_path / "cifar-10-batches-py"), "test")  # the folder itself
    assert same[0].shape == (4, 3, 32, 32)
    with pytest.raises(SystemExit, match="no CIFAR-10 test file"):
        cifar10_data.load_split(str(tmp_path / "nowhere"), "test")


def test_seed_compression_flags_translate():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import seed_flags
    parser = seed_flags.build_parser()

    def params(*argv):
        return seed_flags.compression(parser.parse_args(list(argv)), parser)
    assert params("--optimizer", "parallel_choco", "--comm_op", "compress_top_k", "--compress_ratio", "0.99") == \
        {"compressor": "topk", "k": pytest.approx(0.01)}
    randomk = params("--optimizer", "local_sgd", "--comm_op", "randomk", "--compress_ratio", "0.9")
    assert randomk["k"] == pytest.approx(0.1)
    assert params("--optimizer", "local_sgd", "--comm_op", "sign") == {"compressor": "sign"}
    assert params("--optimizer", "local_ef_sign_sgd")["ef"] == "vanilla"
    assert params("--optimizer", "parallel_choco", "--comm_op", "sign").get("ef") is None
    assert params("--optimizer", "sgd") is None
    with pytest.raises(SystemExit):
        params("--optimizer", "parallel_choco", "--comm_op", "topk")  # no --compress_ratio
    with pytest.raises(SystemExit):
        params("--optimizer", "dpsgd", "--comm_op", "topk", "--compress_ratio", "0.9")


TINY = ["--arch", "resnet20", "--data", "cifar10", "--batch_size", "8", "--num_epochs", "2", "--max_iters", "2",
        "--num_workers", "0", "--lr", "0.05", "--eval_freq", "1"]
RUNS = {
    "sgd": ["--optimizer", "sgd"],
    "local_sgd": ["--optimizer", "local_sgd", "--local_step", "2", "--comm_op", "sign+norm", "--avg_model", "True"],
    "post_local_sgd": ["--optimizer", "post_local_sgd", "--local_step", "2", "--turn_on_local_step_from", "1",
                       "--evaluate_avg", "True", "--lr_scaleup", "True", "--lr_warmup", "True",
                       "--lr_warmup_epochs", "1", "--lr_schedule_scheme", "custom_multistep",
                       "--lr_change_epochs", "1", "--lr_decay", "10", "--track_time", "True",
                       "--display_tracked_time", "True"],
}


RUNS_DECENTRALIZED = {
    "parallel_choco": ["--optimizer", "parallel_choco", "--graph_topology", "ring", "--comm_op", "compress_top_k",
                       "--compress_ratio", "0.99", "--choco_consenus_stepsize", "0.1"],
    "dpsgd": ["--optimizer", "dpsgd", "--graph_topology", "complete"],
}


def tiny_argv(name, checkpoint=False):
    return [*TINY, "--data_dir", "data", "--experiment", name, *{**RUNS, **RUNS_DECENTRALIZED}[name],
            *(["--checkpoint", "ckpt"] if checkpoint else [])]


TORCHRUN_RUNS = ("local_sgd", "parallel_choco")
# tiny runs in the resumed runs' launch (bpslaunch --servers 0) rather than each a parameter-server
# launch of its own (5 processes, 2 of them torch ranks, ~6.5 s of CPU): the script's code on the
# parameter server keeps a run of each of its optimizer families there (local_sgd's bps.LocalSGD,
# parallel_choco's bps.DecentralizedOptimizer); sgd is a plain bps.DistributedOptimizer, and
# post-local SGD and D-PSGD on the servers are tests/test_local_sgd.py's and test_choco_cluster.py's
COLLECTIVE_RUNS = ("sgd", "post_local_sgd", "dpsgd")


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    """name -> (folder, result, resume folder) of TORCHRUN_RUNS's tiny runs, one after the other in
    one launch under torchrun, each checkpointing every epoch into folder/ckpt and copying its
    first checkpoints into resume folder/ckpt as it writes them: test_tiny_run checks them, and
    they are the straight runs that the resume test compares with, resuming from the copies."""
    folders = {name: (tmp_path_factory.mktemp(f"{name}-torchrun"), tmp_path_factory.mktemp(f"{name}-resume"))
               for name in TORCHRUN_RUNS}
    for folder, _ in folders.values():
        write_cifar10(str(folder / "data"))
    result = launch_runs([{"cwd": str(folder), "argv": tiny_argv(name, checkpoint=True), "copy_to": str(resume)}
                          for name, (folder, resume) in folders.items()], tmp_path_factory.mktemp("torchrun"),
                         "torchrun")
    return {name: (folder, result, resume) for name, (folder, resume) in folders.items()}


@pytest.fixture(scope="module")
def resumed_runs(torchrun_runs, tmp_path_factory):
    """{"resumed": name -> (what its resume folder/ckpt held before, result), "tiny": name ->
    (folder, result)}: the same commands as TORCHRUN_RUNS's on the same transport (bpslaunch
    --servers 0), started in the resume folders, then COLLECTIVE_RUNS's tiny runs, each in a
    folder of its own, one after the other in one launch."""
    held = {}
    for name, (_, result, folder) in torchrun_runs.items():
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        held[name] = sorted(os.listdir(folder / "ckpt"))
        write_cifar10(str(folder / "data"))
    tiny = {name: tmp_path_factory.mktemp(f"{name}-collective") for name in COLLECTIVE_RUNS}
    for folder in tiny.values():
        write_cifar10(str(folder / "data"))
    result = launch_runs([*({"cwd": str(folder), "argv": tiny_argv(name, checkpoint=True)}
                            for name, (_, _, folder) in torchrun_runs.items()),
                          *({"cwd": str(folder), "argv": tiny_argv(name)} for name, folder in tiny.items())],
                         tmp_path_factory.mktemp("resumed"), "collective")
    return {"resumed": {name: (held[name], result) for name in torchrun_runs},
            "tiny": {name: (folder, result) for name, folder in tiny.items()}}


@pytest.mark.parametrize("name, launcher", [(n, "bpslaunch") for n in sorted(RUNS) + sorted(RUNS_DECENTRALIZED)
                                              if n not in COLLECTIVE_RUNS]
                         + [(n, "collective") for n in COLLECTIVE_RUNS]
                         + [("local_sgd", "torchrun"), ("parallel_choco", "torchrun")])
def test_tiny_run(name, launcher, tmp_path, request):
    if launcher == "torchrun":  # the fixtures' launches only where a case runs in them
        tmp_path, result, _ = request.getfixturevalue("torchrun_runs")[name]
    elif launcher == "collective":
        tmp_path, result = request.getfixturevalue("resumed_runs")["tiny"][name]
    else:
        write_cifar10(str(tmp_path / "data"))
        result = launch(tiny_argv(name), tmp_path, launcher=launcher)
    data = str(tmp_path / "data")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    summary = json.loads((tmp_path / f"{name}.json").read_text())
    epochs = [row for row in summary["history"] if "epoch" in row]
    assert [row["epoch"] for row in epochs] == [0, 1] and all(row["steps"] == 2 for row in epochs)
    assert all(len(row["test_accuracy"]) == 2 for row in epochs)
    log = (tmp_path / f"{name}.log").read_text()
    assert "traffic per worker" in log and "validation" in log
    bytes_per_step = [row["server_bytes_per_step"] for row in epochs]
    if name == "local_sgd":  # H = 2: one averaging every two steps, signs with a scale
        assert "final: every worker holds the averaged model" in log
        assert bytes_per_step[0] < 0.2 * summary_dense_bytes(tmp_path, data)
    if name in RUNS_DECENTRALIZED:  # nothing through the servers while training; every node evaluated
        assert bytes_per_step == [0, 0] and all(row["gossip_bytes_per_step"] > 0 for row in epochs)
        assert all("averaged_model_accuracy" in row for row in epochs)
    if name == "post_local_sgd":  # synchronous in epoch 0, averaging every 2 steps from epoch 1
        assert bytes_per_step[1] < 0.75 * bytes_per_step[0]
        assert "averaged model accuracy" in log and "forward+backward" in log


@pytest.mark.parametrize("name", ["parallel_choco", "local_sgd"], ids=["choco", "local_sgd"])
def test_choco_script_resumes_from_its_checkpoint_folder(name, torchrun_runs, resumed_runs):
    """Issue 33: the torchrun tiny run (straight), which copied its first checkpoints (after
    epoch 0) into another folder as it wrote them (what a run interrupted right after them
    leaves, without a launch for it), and the same command on the same transport (bpslaunch
    --servers 0) started in that folder, resuming: both end with the same parameters on every
    rank, bit for bit. Both resumed runs share one launch, as both straight runs do."""
    straight, result, tmp_path = torchrun_runs[name]
    held, resumed = resumed_runs["resumed"][name]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert held == ["rank0.pth", "rank1.pth"]  # the copies, nothing else
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resumed from ckpt after epoch 0" in (tmp_path / f"{name}.log").read_text()
    for rank in range(2):
        a = torch.load(straight / "ckpt" / f"rank{rank}.pth", weights_only=True)["model"]
        b = torch.load(tmp_path / "ckpt" / f"rank{rank}.pth", weights_only=True)["model"]
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (rank, key)


def test_unknown_topology_is_a_message(tmp_path):
    # the script checks --graph_topology before it joins a job (main(): check_spec before init()),
    # so the script alone shows the message a worker would print: no launcher, servers or ranks
    data = write_cifar10(str(tmp_path / "data"), n_train=40, n_test=8)
    result = subprocess.run([sys.executable, SCRIPT, *TINY, "--data_dir", data, "--optimizer", "dpsgd",
                             "--graph_topology", "social"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode != 0
    assert "unknown graph topology 'social'" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def summary_dense_bytes(tmp_path, data):
    """Bytes per step of ResNet-20's parameters, dense (float32)."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import train_cifar100_byteps_gc as t
    return 4 * sum(p.numel() for p in t.resnet("resnet20", 10).parameters())


# epfml/ChocoSGD dl_code/README.md, as published but for the interpreter and script path, and
# 3 workers instead of 16 (--n_mpi_process, --world: the smallest ring in which a node's two
# neighbours differ; a worker fewer than 4, ~3 s of CPU); the flags appended after it shrink the run
SEED_COMMAND = """
OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 $HOME/conda/envs/pytorch-py3.6/bin/python run.py \\
    --arch resnet20 --optimizer parallel_choco \\
    --avg_model True --experiment demo --manual_seed 6 \\
    --data cifar10 --pin_memory True \\
    --batch_size 128 --base_batch_size 64 --num_workers 2 \\
    --num_epochs 300 --partition_data random --reshuffle_per_epoch True --stop_criteria epoch \\
    --n_mpi_process 3 --n_sub_process 1 --world 0,0,0 \\
    --on_cuda True --use_ipc False \\
    --lr 0.1 --lr_scaleup True --lr_warmup True --lr_warmup_epochs 5 \\
    --lr_scheduler MultiStepLR --lr_decay 0.1 --lr_milestones 150,225 \\
    --comm_op sign --consensus_stepsize 0.5 --compress_ratio 0.9 --quantize_level 16 --is_biased True \\
    --weight_decay 1e-4 --use_nesterov True --momentum_factor 0.9 \\
    --hostfile hostfile --graph_topology ring --track_time True --display_tracked_time True \\
    --python_path $HOME/conda/envs/pytorch-py3.6/bin/python --mpi_path $HOME/.openmpi/
"""


def test_the_choco_seed_command_runs_as_pasted(tmp_path):
    words = shlex.split(SEED_COMMAND.replace("\\\n", " "))
    assert words[:3] == ["OMP_NUM_THREADS=2", "MKL_NUM_THREADS=2", "$HOME/conda/envs/pytorch-py3.6/bin/python"]
    assert words[3] == "run.py"
    data = write_cifar10(str(tmp_path / "data"))
    tiny = ["--data_dir", data, "--batch_size", "4", "--num_epochs", "1", "--max_iters", "2", "--num_workers", "0"]
    result = launch(words[4:] + tiny, tmp_path, workers=3)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    log = (tmp_path / "demo.log").read_text()
    assert "parallel_choco on 3 workers" in log and "ring of 3" in log
    assert "note: --hostfile not read" in log and "averaged model accuracy" in log
    # --on_cuda True on GPU --world[rank] = 0; this box has none: a note, then the CPU
    assert "note: cuda:0 asked for, but this host has no CUDA device: training on the CPU" in log
    assert "device: cpu (asked: cuda:0)" in log
    assert "final: every worker holds the averaged model" in log
