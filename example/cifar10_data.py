"""CIFAR-10 from the official python version (numpy only): DATA_DIR/cifar-10-batches-py/
data_batch_1..5 and test_batch, pickled dicts with b'data' (uint8 N x 3072) and b'labels', as
unpacked from cifar-10-python.tar.gz. These local files are trusted input (pickle); nothing
received over the network is unpickled. Augmentation and batching: cifar100_data."""
import os
import pickle

import numpy as np

CLASSES = 10
FOLDER = "cifar-10-batches-py"
SPLITS = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
# CIFAR-10 training-set channel statistics (of x / 255)
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32).reshape(1, 3, 1, 1)
STD = np.array([0.2470, 0.2435, 0.2616], np.float32).reshape(1, 3, 1, 1)


def load_split(data_dir, split, flag="--data_dir"):
    """(uint8 N x 3 x 32 x 32 images, int64 labels) of 'train' (the five batches) or 'test';
    ``flag``: the script's option that gave ``data_dir``, named when a file is missing."""
    root = os.path.expanduser(data_dir)
    folder = os.path.join(root, FOLDER)
    if not os.path.isdir(folder) and os.path.isfile(os.path.join(root, SPLITS[split][0])):
        folder = root  # the directory given is cifar-10-batches-py itself
    images, labels = [], []
    for name in SPLITS[split]:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise SystemExit(f"no CIFAR-10 {split} file at {path} (want the python version, "
                             f"cifar-10-python.tar.gz, unpacked in {flag}; nothing is downloaded)")
        with open(path, "rb") as f:
            data = pickle.load(f, encoding="bytes")
        images.append(np.asarray(data[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(data[b"labels"], dtype=np.int64))
        if len(images[-1]) != len(labels[-1]):
            raise SystemExit(f"{path}: {len(images[-1])} images but {len(labels[-1])} labels")
    images, labels = np.concatenate(images), np.concatenate(labels)
    if len(labels) and not 0 <= labels.min() <= labels.max() < CLASSES:
        raise SystemExit(f"{folder}: labels outside [0, {CLASSES})")
    return images, labels


def normalize(images):
    return (images.astype(np.float32) * np.float32(1 / 255) - MEAN) / STD
