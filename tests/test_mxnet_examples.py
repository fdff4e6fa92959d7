"""The gluon training examples (example/mxnet/) on a local cluster: 2 workers, 1 server, a
step or two on tiny data written in the official on-disk formats (CIFAR-100 python pickles;
ImageNet as RecordIO .rec/.idx and as an image folder), with gradient compression on."""
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cluster import run_local
from conftest import LAUNCH_PYTHONPATH, ROOT

if importlib.util.find_spec("mxnet") is None or importlib.util.find_spec("gluoncv") is None:
    pytest.skip("the gluon examples need mxnet and gluoncv", allow_module_level=True)

EXAMPLES = os.path.join(ROOT, "example", "mxnet")
CIFAR = os.path.join(EXAMPLES, "train_cifar100_byteps_gc.py")
IMAGENET = os.path.join(EXAMPLES, "train_gluon_imagenet_byteps_gc.py")
# the ImageNet example's model: its checks (logs, checkpoints, resume) do not depend on which; gluoncv's
# mobilenet0.25 (0.2 M parameters) costs each worker ~1.9 s of CPU less than resnet18_v1 (11 M) to
# build, push and compress
MODEL = "mobilenet0.25"
ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}

NUMBER = r"[0-9]+\.[0-9]+"
SPEED = re.compile(rf"^\[Epoch (\d+)\] speed: \d+ samples/sec\ttime cost: {NUMBER}$", re.M)


def run_example(script, args, cwd, timeout=150):
    """The example on 2 workers and 1 server, in ``cwd`` (where its log file goes)."""
    command = ["sh", "-c", 'cd "$0" && exec "$@"', str(cwd), sys.executable, script, *args]
    result = run_local(command, workers=2, servers=1, env=ENV, timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def values(pattern, text):
    return [float(v) for v in re.findall(pattern, text, re.M)]


def write_cifar(root, train, test, seed=0):
    """CIFAR-100's python version: cifar-100-python/{train,test}, pickled dicts."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    for split, n in (("train", train), ("test", test)):
        data = {b"filenames": [f"img_{i}.png".encode() for i in range(n)],
                b"batch_label": f"{split} batch 1 of 1".encode(),
                b"fine_labels": rng.integers(0, 100, n).tolist(),
                b"coarse_labels": rng.integers(0, 20, n).tolist(),
                b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}
        with open(folder / split, "wb") as f:
            pickle.dump(data, f)


IMAGENET_DATA = textwrap.dedent("""
    import os, sys
    import cv2
    import numpy as np
    from mxnet import recordio

    root, classes = sys.argv[1], 4  # sys.argv[4]: RUN_MAINS's cases
    counts = {"train": int(sys.argv[2]), "val": int(sys.argv[3])}
    rng = np.random.default_rng(0)
    for split, n in counts.items():
        rec = recordio.MXIndexedRecordIO(os.path.join(root, split + ".idx"),
                                         os.path.join(root, split + ".rec"), "w")
        for i in range(n):
            label = i % classes
            image = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
            image[:, :, label % 3] = 64 * label  # a little signal
            header = recordio.IRHeader(0, float(label), i, 0)
            rec.write_idx(i, recordio.pack_img(header, image, quality=90, img_fmt=".jpg"))
            folder = os.path.join(root, "folder", split, "n%08d" % label)
            os.makedirs(folder, exist_ok=True)
            assert cv2.imwrite(os.path.join(folder, "%d.JPEG" % i), image)
        rec.close()
""")


BAD_FLAGS = [
    (IMAGENET, ["--model", MODEL, "--use-pretrained"], "--use-pretrained needs"),
    (CIFAR, ["--ef", "vanilla"], "need --compressor"),
    (CIFAR, ["--compressor", "dithering", "--k", "2.5"], "dithering levels must be a whole number"),
    (CIFAR, ["--compressor", "onebit", "--compress-momentum", "nesterov", "--momentum", "0"],
     "needs --momentum > 0"),
]
# each example's main(argv) in turn, in one process (mxnet imported once, not once a case):
# [exit status, what it wrote to stderr] per (script, args)
RUN_MAINS = textwrap.dedent("""
    import contextlib, importlib.util, io, json, os, sys, traceback

    results = []
    for index, (script, args) in enumerate(json.loads(sys.argv[4])):
        sys.path.insert(0, os.path.dirname(script))  # as when run as a script: its folder first
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                spec = importlib.util.spec_from_file_location(f"example{index}", script)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                module.main(args)
                status = 0
            except SystemExit as e:
                status = e.code
            except Exception:  # this case's failure, not the others' (nor the ImageNet data's)
                status = traceback.format_exc()
        results.append([status, err.getvalue()])
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def mxnet_helper(tmp_path_factory):
    """One process importing mxnet once for two things (IMAGENET_DATA, then RUN_MAINS): the
    ImageNet data's folder, and every BAD_FLAGS case's [exit status, stderr]."""
    root = tmp_path_factory.mktemp("imagenet")
    cases = json.dumps([[script, args] for script, args, _ in BAD_FLAGS])
    result = subprocess.run([sys.executable, "-c", IMAGENET_DATA + RUN_MAINS, str(root), "18", "10", cases],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode == 0, result.stderr[-3000:]
    return root, json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def imagenet(mxnet_helper):
    """18 training and 10 validation 40x40 JPEGs of 4 classes, as .rec/.idx and as a folder.
    Split over 2 workers: 9 training images each (2 batches of 4, one image left over) and
    5 validation images (the second batch of 4 padded by ImageRecordIter)."""
    return mxnet_helper[0]


def test_cifar100_onebit_ef_nesterov(tmp_path):
    # 65 / 33 images: worker 0 gets one more of each; both run 65 // 2 // 16 = 2 steps
    write_cifar(tmp_path / "data", train=65, test=33)
    run_example(CIFAR, ["--data-dir", str(tmp_path / "data"), "--model", "cifar_resnet20_v1",
                        "--num-gpus", "0", "--batch-size", "16", "--num-epochs", "1", "-j", "2",
                        "--compressor", "onebit", "--onebit-scaling", "--ef", "vanilla",
                        "--compress-momentum", "nesterov", "--logging-file", "test",
                        "--save-dir", str(tmp_path / "params"), "--save-period", "1"], tmp_path)
    log = (tmp_path / "out" / "cifar100-2-cpu-test.log").read_text()  # --log-dir's default: out/
    assert [int(e) for e in SPEED.findall(log)] == [0], log
    train = values(rf"^\[Epoch 0\] training: accuracy=({NUMBER})$", log)
    val = values(rf"^\[Epoch 0\] validation: accuracy=({NUMBER})$", log)
    assert len(train) == len(val) == 1, log
    # over all workers, weighted by samples: multiples of 1/64 (trained) and 1/33 (validated)
    assert abs(train[0] * 64 - round(train[0] * 64)) < 1e-4
    assert abs(val[0] * 33 - round(val[0] * 33)) < 1e-4
    assert re.search(r"^\[Epoch 0\] traffic per worker: pushed ", log, re.M), log
    params = tmp_path / "params"
    assert (params / "cifar100-cifar_resnet20_v1-0.params").is_file()
    for r in range(2):  # each rank's codec state beside gluon's states; no temporary file left
        assert (params / f"cifar100-cifar_resnet20_v1-0.states.bps_gc.rank{r}").is_file()
    assert not list(params.glob("*.tmp*"))
    # resume at epoch 1 with the optimizer's and the codec state
    result = run_example(CIFAR, ["--data-dir", str(tmp_path / "data"), "--model", "cifar_resnet20_v1",
                                 "--num-gpus", "0", "--batch-size", "16", "--num-epochs", "2", "-j", "2",
                                 "--compressor", "onebit", "--onebit-scaling", "--ef", "vanilla",
                                 "--compress-momentum", "nesterov", "--logging-file", "resumed",
                                 "--max-iters", "1", "--save-dir", str(params), "--save-period", "1",
                                 "--resume-epoch", "1",
                                 "--resume-from", str(params / "cifar100-cifar_resnet20_v1-0.params"),
                                 "--resume-states", str(params / "cifar100-cifar_resnet20_v1-0.states")],
                         tmp_path)
    assert "starts fresh" not in result.stdout + result.stderr
    log = (tmp_path / "out" / "cifar100-2-cpu-resumed.log").read_text()  # --log-dir's default: out/
    assert [int(e) for e in SPEED.findall(log)] == [1], log
    assert (params / "cifar100-cifar_resnet20_v1-1.states.bps_gc.rank1").is_file()


def test_imagenet_recordio_topk_fp16(imagenet, tmp_path):
    args = ["--use-rec", "--rec-train", str(imagenet / "train.rec"),
            "--rec-train-idx", str(imagenet / "train.idx"),
            "--rec-val", str(imagenet / "val.rec"), "--rec-val-idx", str(imagenet / "val.idx"),
            "--model", MODEL, "--input-size", "32", "--num-classes", "4",
            "--batch-size", "4", "-j", "1", "--log-interval", "1",
            "--compressor", "topk", "--k", "0.01", "--ef", "vanilla", "--fp16-pushpull",
            "--save-dir", str(tmp_path / "params"), "--save-frequency", "2"]
    run_example(IMAGENET, [*args, "--num-epochs", "2", "--logging-file", str(tmp_path / "imagenet.log")],
                tmp_path)
    log = (tmp_path / "imagenet.log").read_text()
    assert [int(e) for e in SPEED.findall(log)] == [0, 1], log
    assert len(re.findall(rf"^Epoch\[\d\] Batch \[\d\]\tSpeed: {NUMBER} samples/sec\terr-top1={NUMBER}\tlr={NUMBER}$",
                          log, re.M)) == 4, log  # 2 epochs of 2 steps
    train = values(rf"^\[Epoch \d\] training: err-top1=({NUMBER})$", log)
    assert len(train) == 2 and all(abs(e * 16 - round(e * 16)) < 1e-4 for e in train), log
    val = re.findall(rf"^\[Epoch \d\] validation: err-top1=({NUMBER}) err-top5=({NUMBER})$", log, re.M)
    assert len(val) == 2, log
    for top1, top5 in val:  # all 10 images, the padding of the last batches left out
        assert abs(float(top1) * 10 - round(float(top1) * 10)) < 1e-4
        assert float(top5) == 0.0  # top-4 of 4 classes
    # --lr 0.1 times 2 worker machines, no decay before epoch 40
    assert set(values(rf"\tlr=({NUMBER})$", log)) == {0.2}, log
    params = tmp_path / "params"
    assert (params / f"imagenet-{MODEL}-1.params").is_file()
    assert (params / f"imagenet-{MODEL}-1.states").is_file()
    for r in range(2):  # each rank's codec state beside gluon's states
        assert (params / f"imagenet-{MODEL}-1.states.bps_gc.rank{r}").is_file()

    # resume at epoch 2 from epoch 1's parameters and trainer states; decay at epoch 2
    result = run_example(IMAGENET, [*args, "--num-epochs", "3", "--max-iters", "1", "--lr-decay-epoch", "2",
                           "--resume-epoch", "2", "--resume-params", str(params / f"imagenet-{MODEL}-1.params"),
                           "--resume-states", str(params / f"imagenet-{MODEL}-1.states"),
                           "--logging-file", str(tmp_path / "resumed.log")], tmp_path)
    assert "starts fresh" not in result.stdout + result.stderr  # the codec state was loaded
    log = (tmp_path / "resumed.log").read_text()
    assert [int(e) for e in SPEED.findall(log)] == [2], log
    assert values(rf"\tlr=({NUMBER})$", log) == [0.02], log
    assert (params / f"imagenet-{MODEL}-2.params").is_file()


def test_imagenet_image_folder_randomk(imagenet, tmp_path):
    run_example(IMAGENET, ["--data-dir", str(imagenet / "folder"), "--model", MODEL,
                           "--input-size", "32", "--num-classes", "4", "--batch-size", "4",
                           "--num-epochs", "1", "--max-iters", "1", "-j", "2", "--mode", "hybrid",
                           "--compressor", "randomk", "--k", "0.01", "--ef", "vanilla",
                           "--compress-momentum", "nesterov", "--save-frequency", "0",
                           "--logging-file", "folder.log"], tmp_path)
    log = (tmp_path / "folder.log").read_text()
    assert [int(e) for e in SPEED.findall(log)] == [0], log
    train = values(rf"^\[Epoch 0\] training: err-top1=({NUMBER})$", log)
    assert len(train) == 1 and abs(train[0] * 8 - round(train[0] * 8)) < 1e-4, log
    val = values(rf"^\[Epoch 0\] validation: err-top1=({NUMBER}) err-top5={NUMBER}$", log)
    assert len(val) == 1 and abs(val[0] * 10 - round(val[0] * 10)) < 1e-4, log
    assert not (tmp_path / "params").exists()


@pytest.fixture(scope="module")
def bad_flag_runs(mxnet_helper):
    """Every BAD_FLAGS case's (exit status, stderr): the examples' own main()."""
    return mxnet_helper[1]


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)),
                         ids=[f"{os.path.basename(script)}-{message}" for script, _, message in BAD_FLAGS])
def test_bad_flags_stop_before_joining(bad_flag_runs, case):
    status, stderr = bad_flag_runs[case]
    assert status == 2, f"{status}\n{stderr[-3000:]}"
    assert BAD_FLAGS[case][2] in stderr, stderr[-3000:]
