"""example/pytorch: the CIFAR-100 training script and the synthetic benchmark.

The CIFAR script runs on a tiny CIFAR-100 written in the official python-pickle format
(64 training and 32 test images) under `bpslaunch --local --workers 2 --servers 1` with a
compressor on; the benchmark runs a small MLP for a few steps. Its helpers (data, augmentation,
learning rate, compression flags, model) are checked in-process.
"""
import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import load_script

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "example", "pytorch")
TRAIN = os.path.join(EXAMPLES, "train_cifar100_byteps_gc.py")
BENCH = os.path.join(EXAMPLES, "benchmark_synthetic.py")
LAUNCH = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", "2", "--servers", "1", "--"]
TIMEOUT = 120


cifar = load_script(TRAIN, "train_cifar100_byteps_gc")


def write_cifar100(data_dir, n_train=64, n_test=32, seed=0):
    """A tiny CIFAR-100 in the official format: data_dir/cifar-100-python/{train,test}."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(data_dir, "cifar-100-python")
    os.makedirs(folder, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        fine = rng.integers(0, 100, n)
        data = {b"filenames": [f"img{i}.png".encode() for i in range(n)], b"batch_label": split.encode(),
                b"fine_labels": fine.tolist(), b"coarse_labels": (fine // 5).tolist(),
                b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}
        with open(os.path.join(folder, split), "wb") as f:
            pickle.dump(data, f, protocol=2)
    return data_dir


def run_job(argv, cwd, timeout=TIMEOUT):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in list(env):
        if name.startswith(("DMLC_", "BYTEPS_LOCAL", "BPS_GC_PORT")):
            del env[name]
    return subprocess.run(LAUNCH + [sys.executable] + argv, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------------------ in-process checks

def test_reads_the_official_pickles(tmp_path):
    write_cifar100(str(tmp_path), n_train=10, n_test=4)
    images, labels = cifar.load_split(str(tmp_path), "train")
    with open(tmp_path / "cifar-100-python" / "train", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert images.shape == (10, 3, 32, 32) and images.dtype == np.uint8
    # rows are 1024 red, 1024 green, 1024 blue values, each row-major 32 x 32
    assert np.array_equal(images[3, 1, 2, 5], raw[b"data"][3, 1024 + 2 * 32 + 5])
    assert labels.tolist() == raw[b"fine_labels"]
    with pytest.raises(SystemExit, match="no CIFAR-100 test set"):
        cifar.load_split(str(tmp_path / "nowhere"), "test")


def test_augment_is_a_padded_crop_and_flip():
    images = np.random.default_rng(1).integers(1, 256, (40, 3, 32, 32), dtype=np.uint8)
    out = cifar.augment(images, np.random.default_rng(7))
    rng = np.random.default_rng(7)  # the draws augment makes, in its order
    dy, dx, flip = rng.integers(0, 9, 40), rng.integers(0, 9, 40), rng.random(40) < 0.5
    padded = np.pad(images, ((0, 0), (0, 0), (4, 4), (4, 4)))
    for i in range(40):
        crop = padded[i, :, dy[i]:dy[i] + 32, dx[i]:dx[i] + 32]
        assert np.array_equal(out[i], crop[:, :, ::-1] if flip[i] else crop)
    x = cifar.normalize(images)
    assert x.dtype == np.float32 and abs(float(x.mean())) < 1.0


def test_compression_params_from_flags():
    parser = cifar.build_parser()

    def params(*argv):
        return cifar.compression_params(parser.parse_args(list(argv)), parser)

    assert params() is None
    assert params("--fp16-pushpull") == {"fp16": True}  # the same declaration as bps.Compression.fp16
    assert params("--compressor", "onebit", "--onebit-scaling", "--ef", "vanilla", "--compress-momentum",
                  "nesterov") == {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"}
    assert params("--compressor", "topk", "--k", "0.001", "--ef", "vanilla") == \
        {"compressor": "topk", "k": 0.001, "ef": "vanilla"}
    assert params("--compressor", "randomk", "--k", "0.001", "--seed", "7") == \
        {"compressor": "randomk", "k": 0.001, "seed": 7}
    assert params("--compressor", "dithering", "--k", "2", "--partition", "natural", "--normalize", "l2") == \
        {"compressor": "dithering", "k": 2.0, "seed": 2020, "partition": "natural", "normalize": "l2"}
    for bad in (["--ef", "vanilla"], ["--compressor", "onebit", "--compress-momentum", "nesterov", "--momentum", "0"],
                ["--compressor", "randomk", "--k", "0.1", "--seed", "0"], ["--compressor", "topk", "--k", "1.5"],
                ["--compressor", "nosuch"]):
        with pytest.raises(SystemExit):
            params(*bad)


def test_learning_rate_schedule():
    parser = cifar.build_parser()
    args = parser.parse_args(["--lr", "0.4", "--warmup-epochs", "2", "--lr-decay-epoch", "5,8"])
    lr = lambda epoch: cifar.learning_rate(args, epoch, [5.0, 8.0])  # noqa: E731
    assert [lr(e) for e in (0, 1, 2, 4.9)] == pytest.approx([0.0, 0.2, 0.4, 0.4])
    assert [lr(e) for e in (5, 7.9, 8, 100)] == pytest.approx([0.04, 0.04, 0.004, 0.004])
    args = parser.parse_args(["--lr", "1", "--lr-decay-period", "3", "--lr-decay", "0.5"])
    assert [cifar.learning_rate(args, e, []) for e in (0, 2.9, 3, 6.5)] == pytest.approx([1, 1, 0.5, 0.25])


@pytest.mark.parametrize("name, params", [("resnet20", 278_324), ("cifar_resnet32_v1", 472_756)])
def test_cifar_resnet(name, params):
    model = cifar.resnet(name)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 100)
    with pytest.raises(ValueError, match="unknown model"):
        cifar.resnet("resnet21")


# ------------------------------------------------------------------------------------ real jobs

EPOCH_LINES = [r"\[Epoch (\d+)\] speed: \d+ samples/sec\ttime cost: \d+\.\d+",
               r"\[Epoch (\d+)\] training: accuracy=(\d\.\d+)",
               r"\[Epoch (\d+)\] validation: accuracy=(\d\.\d+)"]


@pytest.mark.parametrize("job, flags", [
    ("onebit", ["--compressor", "onebit", "--onebit-scaling", "--ef", "vanilla", "--compress-momentum", "nesterov",
                "--num-epochs", "1", "--save-period", "1"]),
    ("dithering_fp16", ["--compressor", "dithering", "--k", "2", "--fp16-pushpull", "--num-epochs", "2",
                        "--max-iters", "1", "--save-period", "0", "--warmup-epochs", "1", "--num-gpus", "0"]),
])
def test_cifar100_script_trains_with_compression(tmp_path, job, flags):
    data_dir = write_cifar100(str(tmp_path / "data"))
    result = run_job([TRAIN, "--data-dir", data_dir, "--batch-size", "8", "-j", "1", "--logging-file", job,
                      "--save-dir", str(tmp_path / "params")] + flags, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = tmp_path / "out" / f"cifar100-2-cpu-{job}.log"  # --log-dir's default: out/
    assert log.exists()
    lines = log.read_text().splitlines()
    epochs = 1 if "onebit" in job else 2
    for epoch in range(epochs):
        found = []
        for pattern in EPOCH_LINES:
            match = [m for m in (re.fullmatch(pattern, line) for line in lines) if m and int(m.group(1)) == epoch]
            assert len(match) == 1, (pattern, lines)
            found.append(match[0])
        # validation: correct and count summed over both workers' halves of the 32 test images
        val = float(found[2].group(2)) * 32
        assert abs(val - round(val)) < 1e-4
        # training: 64 images, 32 per worker, batches of 8: 4 steps each (or --max-iters 1)
        seen = 64 if "onebit" in job else 16
        train = float(found[1].group(2)) * seen
        assert abs(train - round(train)) < 1e-4
    # compressed traffic is reported; rank 0 alone writes the log and the lines reach stdout
    assert any("traffic per worker" in line and "ratio" in line for line in lines)
    device = "device: cpu (asked: cpu)" if "--num-gpus" in flags else "device: cpu (asked: auto)"
    assert device in lines, lines[:5]  # --device auto (or BytePS's --num-gpus 0) on this CPU box
    assert "[worker0] [Epoch 0] speed:" in result.stdout and "[worker1] [Epoch" not in result.stdout
    saved = sorted(os.listdir(tmp_path / "params")) if (tmp_path / "params").exists() else []
    if "onebit" in job:
        # rank 0's parameters, and every rank's whole state for --resume-state
        assert saved == ["cifar100-resnet20-0.params", "cifar100-resnet20-0.r0.state", "cifar100-resnet20-0.r1.state"]
        state = torch.load(tmp_path / "params" / saved[0], weights_only=True)
        cifar.resnet("resnet20").load_state_dict(state)
    else:
        assert saved == []


def test_cifar100_script_without_data_fails_clearly(tmp_path):
    # the data is read before joining a cluster: no cluster needed to see the message
    result = subprocess.run([sys.executable, TRAIN, "--data-dir", str(tmp_path / "none")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "no CIFAR-100 train set" in result.stdout + result.stderr


def test_benchmark_synthetic_prints_a_table(tmp_path):
    out = tmp_path / "bench.json"
    result = run_job([BENCH, "--model", "mlp", "--hidden", "256", "--batch-size", "16", "--num-iters", "2",
                      "--num-warmup", "1", "--configs", "dense,onebit,topk,randomk,dithering", "--json", str(out)],
                     cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line[len("[worker0] "):] for line in result.stdout.splitlines() if line.startswith("[worker0] ")]
    assert lines[0].startswith("model mlp") and "2 workers" in lines[0]
    assert lines[1].split() == ["config", "compression", "img/s/worker", "ms/step", "pushed", "MB/step", "ratio"]
    rows = {line.split()[0]: line for line in lines[3:]}
    assert list(rows) == ["dense", "onebit", "topk", "randomk", "dithering"]
    for name, row in rows.items():
        speed = float(row.split()[-4])
        assert speed > 0, row
    report = json.loads(out.read_text())
    results = {r["config"]: r for r in report["results"]}
    assert report["workers"] == 2 and results["dense"]["ratio"] == pytest.approx(1.0)
    # the big weight (3072 x 256) is compressed: onebit ~32x on it, topk/randomk far more
    assert results["onebit"]["ratio"] > 10
    assert results["topk"]["ratio"] > results["onebit"]["ratio"]
    assert results["randomk"]["ratio"] > results["onebit"]["ratio"]
    assert results["dithering"]["ratio"] > 2
