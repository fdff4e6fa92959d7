"""The language model's text: the Python standard library's own source, read as bytes
(vocabulary 256). No one here wrote it and every machine with Python has it.

The files are every ``*.py`` under the standard library's folder (``sysconfig``'s ``stdlib``),
except third-party packages (site-packages, dist-packages) and the test suites (any folder
named test, tests or idle_test), in sorted order of their relative paths. A file belongs to the
validation split when the CRC-32 of its relative path is 0 mod ``VAL_MODULUS``, else to the
training split: the split of a file never depends on which other files exist, so it repeats on
every machine with the same Python (and mostly across versions). The files of a split are
joined in path order, each followed by a newline.

Training windows are drawn with a numpy generator seeded by (seed, rank, step), so a step's
batch does not depend on how the run got there (a resumed run draws the same ones). Validation
is a fixed set: ``windows`` evenly spaced windows over the validation bytes.
"""
import hashlib
import os
import sysconfig
import zlib

import numpy as np

VAL_MODULUS = 20  # about 5% of the files are held out
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class CorpusTooSmall(SystemExit):
    """A corpus that cannot fill the windows asked for: one line, no traceback."""


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def source_files(root):
    """The relative paths of the corpus's files under ``root``, sorted."""
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        rel = os.path.relpath(folder, root)
        paths += [os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/") for f in files if f.endswith(".py")]
    return sorted(paths)


def is_validation(path):
    return zlib.crc32(path.encode()) % VAL_MODULUS == 0


class Corpus:
    """The two splits of ``root``'s source as uint8 arrays: ``train`` and ``val``."""

    def __init__(self, root=None):
        self.root = root or stdlib_root()
        if not os.path.isdir(self.root):
            raise CorpusTooSmall(f"corpus folder {self.root} does not exist")
        parts = {"train": [], "val": []}
        for path in source_files(self.root):
            with open(os.path.join(self.root, path), "rb") as f:
                parts["val" if is_validation(path) else "train"].append(f.read() + b"\n")
        self.files = {split: len(chunks) for split, chunks in parts.items()}
        self.train = np.frombuffer(b"".join(parts["train"]), dtype=np.uint8)
        self.val = np.frombuffer(b"".join(parts["val"]), dtype=np.uint8)

    def fingerprint(self):
        """SHA-256 (first 16 hex digits) of both splits: equal on machines that read the same text."""
        return hashlib.sha256(self.train.tobytes() + b"\0" + self.val.tobytes()).hexdigest()[:16]

    def describe(self):
        return (f"{self.root}: {self.files['train']} training files ({len(self.train):,} bytes), "
                f"{self.files['val']} validation files ({len(self.val):,} bytes), sha256 {self.fingerprint()}")

    def check(self, context, val_windows, min_train_windows=64):
        """Refuse a corpus whose splits cannot fill ``val_windows`` validation windows and
        ``min_train_windows`` distinct training windows of ``context`` + 1 bytes."""
        need_val, need_train = val_windows * (context + 1), min_train_windows * (context + 1)
        if len(self.val) < need_val or len(self.train) < need_train:
            raise CorpusTooSmall(
                f"corpus {self.root} is too small: {len(self.train)} training and {len(self.val)} validation bytes, "
                f"need at least {need_train} and {need_val} for context {context} and {val_windows} validation windows")
        return self


def train_batch(data, seed, rank, step, batch_size, context):
    """(inputs, targets) int64 arrays of shape (batch_size, context): windows of ``data`` at
    offsets drawn from seed, rank and step only."""
    rng = np.random.default_rng([seed, rank, step])
    starts = rng.integers(0, len(data) - context - 1, size=batch_size)
    windows = np.stack([data[s:s + context + 1] for s in starts]).astype(np.int64)
    return windows[:, :-1], windows[:, 1:]


def val_windows(data, windows, context):
    """The fixed validation set: ``windows`` evenly spaced windows, as (inputs, targets)."""
    starts = np.linspace(0, len(data) - context - 1, windows).astype(np.int64)
    stacked = np.stack([data[s:s + context + 1] for s in starts]).astype(np.int64)
    return stacked[:, :-1], stacked[:, 1:]


def unigram_entropy_bits(train, val):
    """Cross-entropy in bits per byte of ``val`` under ``train``'s byte frequencies (add-one
    smoothed): what a model that ignores context can reach."""
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0
    p = counts / counts.sum()
    return float(-np.log2(p[val]).mean())
