"""CIFAR-100 from the official python version, shared by the MXNet and PyTorch CIFAR-100
examples (numpy only): loading, normalization, augmentation and batch prefetching.

DATA_DIR/cifar-100-python/{train,test} are pickled dicts with b'data' (uint8 N x 3072) and
b'fine_labels', as unpacked from cifar-100-python.tar.gz. These local files are trusted input
(pickle); nothing received over the network is unpickled."""
import collections
import os
import pickle

import numpy as np

CLASSES = 100
# CIFAR-100 training-set channel statistics (of x / 255), as in BytePS's script
MEAN = np.array([0.5070751592371323, 0.48654887331495095, 0.4409178433670343], np.float32).reshape(1, 3, 1, 1)
STD = np.array([0.2673342858792401, 0.2564384629170883, 0.27615047132568404], np.float32).reshape(1, 3, 1, 1)


def load_split(data_dir, split):
    """(uint8 N x 3 x 32 x 32 images, int64 fine labels) from the official python pickles."""
    root = os.path.expanduser(data_dir)
    path = os.path.join(root, "cifar-100-python", split)
    if not os.path.isfile(path) and os.path.isfile(os.path.join(root, split)):
        path = os.path.join(root, split)  # --data-dir is the cifar-100-python folder itself
    if not os.path.isfile(path):
        raise SystemExit(f"no CIFAR-100 {split} set at {path} (want the python version, "
                         "cifar-100-python.tar.gz, unpacked in --data-dir; nothing is downloaded)")
    with open(path, "rb") as f:
        data = pickle.load(f, encoding="bytes")
    images = np.asarray(data[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(data[b"fine_labels"], dtype=np.int64)
    if len(images) != len(labels):
        raise SystemExit(f"{path}: {len(images)} images but {len(labels)} labels")
    if len(labels) and not 0 <= labels.min() <= labels.max() < CLASSES:
        raise SystemExit(f"{path}: fine labels outside [0, {CLASSES})")
    return images, labels


def normalize(images):
    return (images.astype(np.float32) * np.float32(1 / 255) - MEAN) / STD


def augment(images, rng, pad=4):
    """Random crop of the zero-padded image and random horizontal flip (uint8 in and out)."""
    n, c, h, w = images.shape
    padded = np.zeros((n, c, h + 2 * pad, w + 2 * pad), np.uint8)
    padded[:, :, pad:pad + h, pad:pad + w] = images
    dy = rng.integers(0, 2 * pad + 1, n)
    dx = rng.integers(0, 2 * pad + 1, n)
    rows = (dy[:, None] + np.arange(h))[:, None, :, None]  # n x 1 x h x 1
    cols = (dx[:, None] + np.arange(w))[:, None, None, :]  # n x 1 x 1 x w
    flip = rng.random(n) < 0.5
    cols = np.where(flip[:, None, None, None], cols[..., ::-1], cols)
    return padded[np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None], rows, cols]


def prefetch(executor, fn, items, depth):
    """fn(item) for each item, computed up to ``depth`` ahead on the executor."""
    if executor is None:
        for item in items:
            yield fn(item)
        return
    pending = collections.deque()
    for item in items:
        pending.append(executor.submit(fn, item))
        if len(pending) > depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def epoch_batches(seed, epoch, images, rank, size, steps, batch_size):
    """(epoch, step, indices) of this worker's batches: one permutation per epoch, the same on
    every worker, of which each takes every size-th image."""
    order = np.random.default_rng([seed, epoch]).permutation(images)
    mine = order[rank::size][:steps * batch_size]
    return [(epoch, i, mine[i * batch_size:(i + 1) * batch_size]) for i in range(steps)]
