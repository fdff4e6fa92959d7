"""Every command line printed in the five systems' READMEs (../shared/seeds/*.txt), mapped to
bps_gc by replacing only the launcher and the script's path (docs/seeds.md lists the same
lines), run with every other flag as printed: on tiny data, with the script's --dry-run or a
reduced size where the printed length would take hours (docs/seeds.md says which).

Lines other tests already run are not run again here: DGC's (test_dgc_train.py, whose flags
are checked to be the printed ones) and BytePS's run.sh/scheduler.sh/server.sh
(test_launch_scripts.py). BytePS's MXNet worker lines are all checked at their scripts' flag
parsing and one of them runs on a cluster (a cluster run per line would take minutes)."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from bps_gc.launcher.local import free_port
from conftest import LAUNCH_PYTHONPATH, ROOT, skip_unless_installed
from test_cifar10_choco import write_cifar10
from test_study_scripts import TINY_PHASES, write_imagenet

DOCS = os.path.join(ROOT, "docs", "seeds.md")

# --- as printed (continuation lines joined) -------------------------------------------------
CHOCO = (  # 001_8f605ac90a4aae88.txt
    "$HOME/conda/envs/pytorch-py3.6/bin/python run.py --arch resnet20 --optimizer parallel_choco "
    "--avg_model True --experiment demo --data cifar10 --pin_memory True "
    "--batch_size 128 --base_batch_size ${base_batch_size[j]} --num_workers 2 --eval_freq 1 "
    "--num_epochs 300 --partition_data random --reshuffle_per_epoch True --stop_criteria epoch "
    "--n_mpi_process 16 --n_sub_process 1 --world 0,0,0,0,0,0,0,0 --on_cuda True --use_ipc False --comm_device cuda "
    "--lr 0.1 --lr_scaleup True --lr_scaleup_factor graph --lr_warmup True --lr_warmup_epochs 5 "
    "--lr_schedule_scheme custom_multistep --lr_change_epochs 150,225 --lr_decay 10 "
    "--weight_decay 1e-4 --use_nesterov True --momentum_factor 0.9 "
    "--comm_op sign --choco_consenus_stepsize 0.5 --compress_ratio 0.9 --quantize_level 16 --is_biased True "
    "--hostfile iccluster/hostfile --graph_topology ring --track_time True --display_tracked_time True "
    "--python_path $HOME/conda/envs/pytorch-py3.6/bin/python --mpi_path $HOME/.openmpi/ --evaluate_avg True")
STUDY = (  # 002_efbda41bf7694c2f.txt
    "python -m torch.distributed.launch --nproc_per_node=NUM_GPUS_PER_NODE --nnodes=NUM_NODES --node_rank=RANK "
    "--master_addr=MASTER_ADDR --master_port=MASTER_PORT training/train_imagenet_nv.py --logdir LOG_DIR "
    "--distributed --init-bn0 --no-bn-wd --name RUN_NAME --compress='layerwise' --method='Topk' --ratio=0.3")
BYTEPS_CIFAR = "example/mxnet/gradient_compression/train_cifar100_byteps_gc.py"
BYTEPS_IMAGENET = "example/mxnet/gradient_compression/train_gluon_imagenet_byteps_gc.py"
CIFAR_BASE = ("--model resnet18_v2 --mode hybrib --batch-size 32 --num-gpus 1 --num-epochs {e} -j 2 "
              "--warmup-epochs 10 --warmup-lr 0.1 --lr 0.1 --logging-file ${{1}}")
REC = ("--rec-train ~/data/ILSVRC2012/train.rec --rec-train-idx ~/data/ILSVRC2012/train.idx "
       "--rec-val ~/data/ILSVRC2012/val.rec --rec-val-idx ~/data/ILSVRC2012/val.idx --use-rec")
BYTEPS_WORKER = {  # 003_1246a012bbbb232c.txt: worker.sh's lines (nohup/redirections left out)
    "cifar100 baseline": f"bpslaunch python {BYTEPS_CIFAR} {CIFAR_BASE.format(e=20)}",
    "cifar100 onebit": f"bpslaunch python {BYTEPS_CIFAR} {CIFAR_BASE.format(e=200)} --compressor onebit "
                       "--onebit-scaling --ef vanilla --compress-momentum nesterov",
    "cifar100 topk": f"bpslaunch python {BYTEPS_CIFAR} {CIFAR_BASE.format(e=200)} --compressor topk --k 0.001",
    "cifar100 randomk": f"bpslaunch python {BYTEPS_CIFAR} {CIFAR_BASE.format(e=200)} --compressor randomk --k 0.001",
    "cifar100 dithering": f"bpslaunch python {BYTEPS_CIFAR} {CIFAR_BASE.format(e=200)} --compressor dithering "
                          "--k 2 --normalize l2",
    "cifar100 onebit fp16": f"bpslaunch python {BYTEPS_CIFAR} {CIFAR_BASE.format(e=200)} --compressor onebit "
                            "--onebit-scaling --ef vanilla --compress-momentum nesterov --fp16-pushpull",
    "resnet50_v2 baseline": f"bpslaunch python3 {BYTEPS_IMAGENET} --model resnet50_v2 --mode hybrid {REC} "
                            "--batch-size 64 --num-gpus 1 --num-epochs 120 -j 2 --warmup-epochs 5 --warmup-lr 0.2 "
                            "--lr 0.2 --lr-mode cosine --logging-file baseline",
    "resnet50_v2 onebit": f"bpslaunch python3 {BYTEPS_IMAGENET} --model resnet50_v2 --mode hybrid {REC} "
                          "--batch-size 64 --num-gpus 1 --num-epochs 120 -j 2 --warmup-epochs 5 --warmup-lr 0.1 "
                          "--lr 0.1 --lr-mode cosine  --logging-file onebit --compressor onebit --onebit-scaling "
                          "--ef vanilla --compress-momentum nesterov",
    "vgg16 baseline": f"bpslaunch python3 {BYTEPS_IMAGENET} --model vgg16 --mode hybrid  {REC} --batch-size 32 "
                      "--num-gpus 1 --num-epochs 100 -j 2 --warmup-epochs 5 --warmup-lr 0.01 --lr 0.01 "
                      "--lr-decay-epoch 50,80 --logging-file baseline",
    "vgg16 onebit": f"bpslaunch python3 {BYTEPS_IMAGENET} --model vgg16 --mode hybrid  {REC} --batch-size 32 "
                    "--num-gpus 1 --num-epochs 100 -j 2 --warmup-epochs 5 --warmup-lr 0.01 --lr 0.01 "
                    "--lr-decay-epoch 50,80 --logging-file onebit --compressor onebit --onebit-scaling --ef vanilla "
                    "--compress-momentum nesterov",
}
DGC = {  # 004_0daf4acec4030dc0.txt
    "cifar": "horovodrun -np 8 python train.py --configs configs/cifar/resnet20.py "
             "configs/dgc/wm5.py configs/dgc/fp16.py configs/dgc/int32.py",
    "imagenet": "mpirun -np 32 -H server0:8,server1:8,server2:8,server3:8 -bind-to none -map-by slot "
                "-x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH -x PATH -mca pml ob1 -mca btl ^openib "
                "-mca btl_tcp_if_exclude docker0,lo python train.py --configs configs/imagenet/resnet50.py "
                "configs/dgc/wm0.py",
    "e500": "horovodrun -np 8 python train.py --configs configs/cifar/resnet20.py "
            "configs/dgc/wm5.py --configs.train.num_epochs 500 --suffix .e500",
}

# --- ours: (printed, launcher printed, our launcher, script printed, our script) ------------
ROWS = {
    "choco": (CHOCO, "$HOME/conda/envs/pytorch-py3.6/bin/python", "bpslaunch --local --workers 16 -- python",
              "run.py", "example/pytorch/train_cifar10_choco.py"),
    "study": (STUDY, "python -m torch.distributed.launch", "torchrun",
              "training/train_imagenet_nv.py", "example/pytorch/train_imagenet_nv.py"),
    "dgc cifar": (DGC["cifar"], "horovodrun -np 8 python", "torchrun --nproc-per-node 8",
                  "train.py", "example/pytorch/dgc/train.py"),
    "dgc imagenet": (DGC["imagenet"], DGC["imagenet"].split(" python ")[0] + " python",
                     "torchrun --nnodes 4 --node-rank R --nproc-per-node 8 --master-addr server0 --master-port 29500",
                     "train.py", "example/pytorch/dgc/train.py"),
    "dgc e500": (DGC["e500"], "horovodrun -np 8 python", "bpslaunch --local --workers 8 --servers 1 -- python",
                 "train.py", "example/pytorch/dgc/train.py"),
    **{f"byteps {name}": (line, line.split()[0] + " " + line.split()[1], line.split()[0] + " " + line.split()[1],
                          line.split()[2], line.split()[2].replace("gradient_compression/", ""))
       for name, line in BYTEPS_WORKER.items()},
}


def ours(name):
    printed, launcher, our_launcher, script, our_script = ROWS[name]
    assert printed.startswith(launcher + " ") and f" {script} " in printed, name
    rest = printed[len(launcher):]
    return our_launcher + rest.replace(f" {script} ", f" {our_script} ", 1)


def words(text):
    return " ".join(text.replace("\\\n", " ").split())


def test_docs_table_lists_every_mapped_line():
    docs = words(open(DOCS).read())
    for name in ROWS:
        assert words(ours(name)) in docs, f"docs/seeds.md lacks the {name} line:\n{ours(name)}"


def test_the_dgc_lines_are_the_ones_test_dgc_train_runs():
    import test_dgc_train as dgc
    for key, flags in (("dgc cifar", dgc.SEED_CIFAR), ("dgc imagenet", dgc.SEED_IMAGENET), ("dgc e500", dgc.SEED_E500)):
        assert ours(key).endswith("example/pytorch/dgc/train.py " + flags)


def wrappers(tmp_path):
    """bin/ with bpslaunch, torchrun and python as a user has them on PATH; example/ as in the repo."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    commands = {"python": f"exec {sys.executable} \"$@\"",
                "bpslaunch": f"exec {sys.executable} -m bps_gc.launcher.cli \"$@\"",
                "torchrun": f"exec {sys.executable} -m torch.distributed.run \"$@\""}
    for name, body in commands.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    os.symlink(os.path.join(ROOT, "example"), tmp_path / "example")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_", "BPS_GC_"))}
    # HOME: the printed ~/data paths point into tmp_path; the compiled kernels stay in the user's cache
    cache = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return dict(env, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=LAUNCH_PYTHONPATH, OMP_NUM_THREADS="1",
                HOME=str(tmp_path), XDG_CACHE_HOME=cache, BPS_GC_HEARTBEAT_TIMEOUT="60")


def test_choco_line_on_16_workers(tmp_path):
    """The printed command on 16 workers, with --dry-run: every worker joins the job and checks
    the flags against it (--n_mpi_process 16, --world's 8 ids), rank 0 logs the plan."""
    pytest.importorskip("torch")
    write_cifar10(str(tmp_path / "data"), n_train=32, n_test=16)  # ./data/: the printed --data_dir default
    script = "base_batch_size=(128); j=0\n" + ours("choco") + " --dry-run\n"  # the README's sweep variable
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=wrappers(tmp_path), capture_output=True,
                            text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Traceback" not in result.stdout + result.stderr
    log = (tmp_path / "demo.log").read_text()
    assert "dry run: parallel_choco on 16 workers, ring of 16" in log
    assert "--world 0,0,0,0,0,0,0,0: 8 GPU ids, repeated over the 16 processes" in log
    assert "--compress_ratio 0.9: no effect with --comm_op sign" in log and "--is_biased: no effect" in log
    # 0.1 * (128 / 128) * 3 (a ring node and its two neighbours), warmed up from 0.1 over 5 epochs,
    # then divided by 10 at 150 and at 225
    assert "learning rate epoch 0: 0.1, epoch 5: 0.3, epoch 150: 0.03, epoch 225: 0.003" in log
    assert "compression_params {'compressor': 'signnorm'}" in log


def test_study_line_under_torchrun(tmp_path):
    """The placeholders filled in (2 processes on 1 node, a free port), the data at the script's
    default ~/data/imagenet; a tiny model and schedule appended (the printed run is ResNet-50 for
    18 epochs)."""
    pytest.importorskip("torch")
    write_imagenet(str(tmp_path / "data" / "imagenet"))
    line = ours("study")
    for placeholder, value in (("NUM_GPUS_PER_NODE", "2"), ("NUM_NODES", "1"), ("=RANK", "=0"),
                               ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("LOG_DIR", "logs")):
        line = line.replace(placeholder, value)
    line += f" --arch resnet18 --width 4 --phases {shlex.quote(TINY_PHASES)} --short-epoch"
    result = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=wrappers(tmp_path), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads((tmp_path / "logs" / "RUN_NAME.json").read_text())
    assert summary["workers"] == 2 and summary["transport"] == "collective"
    assert summary["compression_params"] == {"compressor": "topk", "k": 0.3}
    assert summary["history"][0]["steps"] == 2


# each line's flags through its script's parser and compression flags, in one process of its own
# (the MXNet scripts share module names with the PyTorch ones)
PARSE = """
import importlib, json, os, shlex, sys
root, lines = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.join(root, "example", "mxnet"))
out = {}
for name, line in lines.items():
    launcher, python, script, *argv = shlex.split(line.replace("${1}", "onebit"))
    module = importlib.import_module(os.path.basename(script)[:-3])
    parser = module.build_parser()
    args = parser.parse_args(argv)  # exits 2 on a flag it refuses
    out[name] = {"launcher": [launcher, python, os.path.isfile(os.path.join(root, script))], "mode": args.mode,
                 "num_gpus": args.num_gpus, "params": module.compression_params(args, parser)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def byteps_lines():
    skip_unless_installed("mxnet")  # the launched processes import it
    lines = {name: ours(f"byteps {name}") for name in BYTEPS_WORKER}
    result = subprocess.run([sys.executable, "-c", PARSE, ROOT, json.dumps(lines)], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(BYTEPS_WORKER))
def test_byteps_worker_lines(name, byteps_lines):
    """Every flag as printed parses, the CIFAR-100 lines' --mode hybrib (the recipe's spelling)
    included; test_byteps_cifar_line_runs runs one on a cluster."""
    got = byteps_lines[name]
    line = ours(f"byteps {name}")
    assert got["launcher"] == ["bpslaunch", line.split()[1], True]
    assert got["mode"] == re.search(r"--mode (\w+)", line).group(1)
    assert got["num_gpus"] == 1
    compressor = re.search(r"--compressor (\w+)", line)
    params = got["params"] or {}
    assert params.get("compressor") == (compressor.group(1) if compressor else None)
    assert bool(params.get("fp16")) == ("--fp16-pushpull" in line)


@pytest.mark.parametrize("world, processes, outcome", [
    ("0,0,0,0,0,0,0,0", 16, "8 GPU ids, repeated over the 16 processes; unused"),  # the README's
    ("0,1,0,1", 4, "4 GPU ids; unused"),  # one per process (2 processes x 2 GPUs in the README's text)
    ("0,0,0", 16, "3 GPU ids, repeated over the 16 processes"),
    ("0,0,0,0,0", 4, "SystemExit: --world lists 5 devices for 4 worker processes"),
    ("0,gpu1", 2, "SystemExit: --world 0,gpu1: want comma-separated GPU ids"),
])
def test_choco_world_means_what_it_can(world, processes, outcome, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "example", "pytorch"))
    import seed_flags
    import train_cifar10_choco as choco
    args = seed_flags.build_parser().parse_args(["--world", world])
    try:
        got = " ".join(choco.world_notes(args, processes))
    except SystemExit as e:
        got = f"SystemExit: {e}"
    assert outcome in got


def test_choco_flags_sign_does_not_read_are_notes(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "example", "pytorch"))
    import seed_flags
    argv = ["--optimizer", "parallel_choco", "--comm_op", "sign", "--compress_ratio", "0.9", "--is_biased", "True"]
    notes = seed_flags.unused_flag_notes(seed_flags.build_parser().parse_args(argv), argv)
    assert len(notes) == 2 and "--compress_ratio 0.9: no effect" in notes[0] and "--is_biased" in notes[1]
    argv = ["--optimizer", "parallel_choco", "--comm_op", "qsgd", "--quantize_level=8", "--is_biased", "True"]
    assert seed_flags.unused_flag_notes(seed_flags.build_parser().parse_args(argv), argv) == []


def test_byteps_cifar_line_runs(tmp_path):
    """The printed onebit fp16 line on 2 workers and a server, on tiny CIFAR-100 files: --mode
    hybrib trains imperatively and --num-gpus 1 on this GPU-less machine trains on the CPU, each
    with a note; the recipe's 200 epochs of resnet18_v2 become one of a small model."""
    skip_unless_installed("mxnet")  # the launched processes import it
    from cluster import run_local
    from test_mxnet_examples import write_cifar
    write_cifar(tmp_path / "data", train=65, test=33)
    launcher, python, script, *argv = shlex.split(ours("byteps cifar100 onebit fp16").replace("${1}", "onebit"))
    reduced = ["--data-dir", str(tmp_path / "data"), "--model", "cifar_resnet20_v1", "--num-epochs", "1",
               "--batch-size", "16", "--save-period", "0"]
    command = ["sh", "-c", 'cd "$0" && exec "$@"', str(tmp_path), sys.executable, os.path.join(ROOT, script),
               *argv, *reduced]
    result = run_local(command, workers=2, servers=1, env={"OMP_NUM_THREADS": "1"}, timeout=150)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "note: --mode hybrib is not 'hybrid'" in out and "note: --num-gpus 1, but MXNet sees no GPU" in out
    assert re.search(r"\[Epoch 0\] traffic per worker: pushed .*ratio", out), out[-3000:]
