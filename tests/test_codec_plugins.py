"""Codecs from outside the package: the registry, BPS_GC_PLUGINS and malformed payloads."""
import os
import subprocess
import sys

import numpy as np
import pytest

from bps_gc.compress import Codec, build_chain, register_compressor
from conftest import LAUNCH_PYTHONPATH, ROOT

PLUGIN_DIR = os.path.join(ROOT, "example", "plugins")


@register_compressor("test_halves")
class Halves(Codec):
    """Sends float16 copies: a codec defined in a test, outside bps_gc."""

    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)

    def compress(self, x, ctx=None):
        return self._input(x).astype(np.float16).view(np.uint8)

    def decompress(self, payload, out=None):
        out = self._output(out)
        out[:] = self._payload(payload, 2 * self.n).view(np.float16)
        return out


def test_registered_codec_round_trips_with_error_feedback():
    x = np.linspace(-1, 1, 101).astype(np.float32)
    codec = build_chain({"compressor": "test_halves", "ef": "vanilla"}, 101, np.float32)
    payload = codec.compress(x, {"lr": 0.1})
    assert payload.size == 202
    assert np.array_equal(codec.decompress(payload), x.astype(np.float16).astype(np.float32))
    assert np.array_equal(codec.error, x - x.astype(np.float16).astype(np.float32))


def test_registering_a_non_codec_or_a_taken_name_fails():
    with pytest.raises(TypeError, match="subclass"):
        register_compressor("not_a_codec")(object)
    with pytest.raises(ValueError, match="already registered"):
        register_compressor("onebit")(Halves)


def run_python(code, **env):
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([LAUNCH_PYTHONPATH, PLUGIN_DIR]), **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=60)


def test_plugin_module_from_environment_round_trips():
    code = (
        "import numpy as np\n"
        "from bps_gc.compress import build_chain\n"
        "x = np.linspace(-2, 2, 1000).astype(np.float32)\n"
        "c = build_chain({'compressor': 'int8', 'int8_round': 'nearest'}, 1000, np.float32)\n"
        "p = c.compress(x)\n"
        "y = c.decompress(p)\n"
        "assert p.size == 1004, p.size\n"
        "assert np.abs(y - x).max() <= 2 / 127 / 2 + 1e-6\n"
        "print('ok', p.size)\n")
    result = run_python(code, BPS_GC_PLUGINS="bps_gc_int8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok 1004"
    # without the variable the name is unknown, and the error lists what is known
    result = run_python(code, BPS_GC_PLUGINS="")
    assert result.returncode != 0 and "unknown compressor 'int8'" in result.stderr


def test_plugin_option_is_validated():
    result = run_python("from bps_gc.compress import CompressionParams as P\n"
                        "P.from_dict(compressor='int8', int8_round='up')",
                        BPS_GC_PLUGINS="bps_gc_int8")
    assert "compression parameter 'int8_round': bad value 'up': allowed: nearest, floor" in result.stderr


def test_missing_plugin_module_names_the_variable():
    result = run_python("from bps_gc.compress import CompressionParams as P\n"
                        "P.from_dict(compressor='onebit')", BPS_GC_PLUGINS="no_such_plugin_mod")
    assert "BPS_GC_PLUGINS: cannot import plugin module 'no_such_plugin_mod'" in result.stderr


@pytest.mark.parametrize("params", [{"compressor": "onebit"}, {"compressor": "topk", "k": 5},
                                    {"compressor": "randomk", "k": 5, "seed": 1},
                                    {"compressor": "dithering", "k": 3, "seed": 1},
                                    {"compressor": "dithering", "k": 3, "partition": "natural"}])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_decoders_reject_malformed_payloads_without_crashing(params, dtype):
    n = 100
    codec = build_chain(params, n, dtype)
    good = codec.compress(np.random.default_rng(0).standard_normal(n).astype(dtype))
    rng = np.random.default_rng(1)
    rejected = 0
    for trial in range(2000):
        kind = trial % 4
        if kind == 0:
            bad = rng.integers(0, 256, rng.integers(0, 3 * good.size + 2), dtype=np.uint8)
        elif kind == 1:
            bad = good[: rng.integers(0, good.size)].copy()
        elif kind == 2:
            bad = good.copy()
            bad[rng.integers(0, bad.size, 3)] ^= rng.integers(1, 256, 3, dtype=np.uint8)
        else:
            bad = np.concatenate([good, rng.integers(0, 256, rng.integers(1, 9), dtype=np.uint8)])
        try:
            y = codec.decompress(bad)
            assert y.shape == (n,)
        except ValueError:
            rejected += 1
    assert rejected > 0


def test_out_of_range_index_is_rejected_before_writing():
    codec = build_chain({"compressor": "topk", "k": 2}, 10, np.float32)
    rec = np.zeros(2, [("i", "<u4"), ("v", "<f4")])
    rec["i"], rec["v"] = [3, 10], [1.0, 2.0]
    out = np.full(10, 7.0, np.float32)
    with pytest.raises(ValueError, match="index out of range"):
        codec.decompress(rec.view(np.uint8), out)
    assert np.all(out == 7.0)
