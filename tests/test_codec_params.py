"""Compression parameters: friendly and BytePS spellings, validation, JSON round trip."""
import json

import numpy as np
import pytest

from bps_gc.compress import CompressionParams, ParamError, build_chain


def test_friendly_and_byteps_spellings_agree():
    friendly = CompressionParams.from_dict(
        {"compressor": "dithering", "k": 4, "seed": 7, "partition": "natural",
         "normalize": "l2", "ef": "vanilla", "momentum": "nesterov", "mu": 0.9})
    byteps = CompressionParams.from_dict(
        byteps_compressor_type="dithering_compressor", byteps_compressor_k="4",
        byteps_seed="7", byteps_dithering_partition="1", byteps_dithering_normalize="1",
        byteps_ef_type="vanilla_ef", byteps_momentum_type="nesterov_momentum",
        byteps_momentum_mu="0.9")
    assert friendly == byteps
    assert CompressionParams.from_dict(byteps_compressor_type="onebit",
                                       byteps_compressor_onebit_scaling="true").scaling is True


def test_json_round_trip_without_pickle():
    p = CompressionParams.from_dict(compressor="topk", k=0.001, ef="vanilla", fp16=True)
    data = p.to_json()
    assert json.loads(data) == {"compressor": "topk", "k": 0.001, "ef": "vanilla", "fp16": True}
    assert CompressionParams.from_json(data) == p
    with pytest.raises(ValueError, match="JSON"):
        CompressionParams.from_json(b"\x80\x04not json")
    with pytest.raises(ParamError, match="'compressor'"):
        CompressionParams.from_json(b'{"compressor": "zip"}')


@pytest.mark.parametrize("params, key, fragment", [
    ({"compressor": "zip"}, "compressor", "unknown compressor 'zip'; allowed: adaptive_threshold, dgc, dithering"),
    ({"compressor": "topk"}, "k", "needs k"),
    ({"compressor": "topk", "k": 0}, "k", "> 0"),
    ({"compressor": "topk", "k": -0.1}, "k", "> 0"),
    ({"compressor": "topk", "k": 2.5}, "k", "whole"),
    ({"compressor": "topk", "k": "many"}, "k", "number"),
    ({"compressor": "topk", "k": True}, "k", "number"),
    ({"compressor": "dithering", "k": 2.5}, "k", "whole number"),
    ({"compressor": "dithering", "k": 0}, "k", "> 0"),
    ({"compressor": "dithering", "k": 40, "partition": "natural"}, "k", "at most 31"),
    ({"compressor": "randomk", "k": 0.1, "seed": 0}, "seed", "[1, 2**64)"),
    ({"compressor": "randomk", "k": 0.1, "seed": "abc"}, "seed", "integer"),
    ({"compressor": "dithering", "k": 2, "partition": "log"}, "partition", "linear, natural"),
    ({"compressor": "dithering", "k": 2, "normalize": "l1"}, "normalize", "max, l2"),
    ({"ef": "vanilla"}, "ef", "needs a compressor"),
    ({"momentum": "nesterov", "mu": 0.9}, "momentum", "needs a compressor"),
    ({"compressor": "onebit", "momentum": "nesterov"}, "momentum", "needs 'mu'"),
    ({"compressor": "onebit", "momentum": "heavyball", "mu": 0.9}, "momentum", "allowed: nesterov"),
    ({"compressor": "onebit", "ef": "sparse"}, "ef", "allowed: vanilla"),
    ({"compressor": "onebit", "mu": 1.5}, "mu", "[0, 1)"),
    ({"compressor": "onebit", "scaling": "yes"}, "scaling", "true or false"),
    ({"compressor": "onebit", "fp16": 2}, "fp16", "true or false"),
    ({"compressor": "onebit", "compresor": "x"}, "compresor", "unknown key"),
    # issue 11's codecs
    ({"compressor": "terngrad", "clip": "yes"}, "clip", "true or false"),
    ({"compressor": "qsgd", "levels": 0}, "levels", "[1, 16777215]"),
    ({"compressor": "qsgd", "levels": 2.5}, "levels", "whole number"),
    ({"compressor": "qsgd", "biased": 3}, "biased", "true or false"),
    ({"compressor": "topk", "k": 0.1, "levels": 3}, "levels", "unknown key"),
    ({"compressor": "threshold"}, "threshold", "needs 'threshold'"),
    ({"compressor": "threshold", "threshold": -1}, "threshold", "finite number"),
    ({"compressor": "threshold", "threshold": float("nan")}, "threshold", "finite number"),
    ({"compressor": "dgc"}, "k", "needs k"),
    ({"compressor": "dgc", "k": 0.01, "sample_ratio": 0}, "sample_ratio", "(0, 1]"),
    ({"compressor": "dgc", "k": 0.01, "warmup_epochs": -1}, "warmup_epochs", "whole number"),
    ({"compressor": "dgc", "k": 0.01, "warmup_densities": [0.5, 0]}, "warmup_densities", "(0, 1]"),
    ({"compressor": "dgc", "k": 0.01, "warmup_densities": "0.5"}, "warmup_densities", "list"),
    ({"compressor": "dgc", "k": 0.01, "warmup_epochs": 2, "warmup_densities": [0.5]},
     "warmup_densities", "either"),
    ({"compressor": "dgc", "k": 0.01, "clip_norm": 0}, "clip_norm", "(0, inf]"),
    ({"compressor": "dgc", "k": 0.01, "fp16_values": "no"}, "fp16_values", "true or false"),
    ({"compressor": "dgc", "k": 0.01, "ef": "vanilla"}, "ef", "its own error feedback"),
    ({"compressor": "powersgd", "rank": 0}, "rank", "whole number"),
    ({"compressor": "powersgd", "rank": float("inf")}, "rank", "whole number"),
])
def test_bad_parameter_names_the_key(params, key, fragment):
    with pytest.raises(ParamError) as err:
        CompressionParams.from_dict(params)
    assert err.value.key == key
    assert repr(key) in str(err.value) and fragment in str(err.value)


@pytest.mark.parametrize("kwargs, key", [
    ({"byteps_compressor_k": "abc", "byteps_compressor_type": "topk"}, "byteps_compressor_k"),
    ({"byteps_seed": "1.5", "byteps_compressor_type": "randomk", "byteps_compressor_k": "2"}, "byteps_seed"),
    ({"byteps_compressor_onebit_scaling": "maybe", "byteps_compressor_type": "onebit"},
     "byteps_compressor_onebit_scaling"),
    ({"byteps_compressor_k": "2", "k": 2, "byteps_compressor_type": "topk"}, "k"),
])
def test_bad_byteps_string_names_the_kwarg(kwargs, key):
    with pytest.raises(ParamError) as err:
        CompressionParams.from_dict(**kwargs)
    assert err.value.key == key


def test_build_chain_rejects_bad_shapes_and_dtypes():
    with pytest.raises(TypeError, match="int32"):
        build_chain({"compressor": "onebit"}, 10, np.int32)
    with pytest.raises(ValueError, match=">= 1 element"):
        build_chain({"compressor": "onebit"}, 0, np.float32)
    with pytest.raises(ValueError, match="role"):
        build_chain({"compressor": "onebit"}, 10, np.float32, role="scheduler")
    codec = build_chain({"compressor": "onebit"}, 10, np.float32)
    with pytest.raises(ValueError, match="expected 10 elements of float32"):
        codec.compress(np.zeros(11, np.float32))
    with pytest.raises(ValueError, match="expected 10 elements of float32"):
        codec.compress(np.zeros(10, np.float64))


def test_unseeded_codecs_agree_across_processes_by_key():
    # no seed: every process derives the same seed from the partition key (BytePS did not)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    a = build_chain({"compressor": "randomk", "k": 10}, 1000, np.float32, key=42)
    b = build_chain({"compressor": "randomk", "k": 10}, 1000, np.float32, key=42)
    c = build_chain({"compressor": "randomk", "k": 10}, 1000, np.float32, key=43)
    pa = a.compress(x).tobytes()
    assert pa == b.compress(x).tobytes()
    assert pa != c.compress(x).tobytes()


def test_issue11_options_round_trip_through_json():
    p = CompressionParams.from_dict({"compressor": "dgc", "k": 0.001, "warmup_densities": [0.25, 0.0625],
                                     "fp16_values": True, "clip_norm": 5, "mu": 0.9,
                                     "momentum": "nesterov", "sample_ratio": 0.02})
    assert CompressionParams.from_json(p.to_json()) == p
    assert p.option("warmup_densities") == (0.25, 0.0625) and p.option("clip_norm") == 5.0
    q = CompressionParams.from_dict({"compressor": "qsgd", "levels": 15, "biased": True, "seed": 3})
    assert CompressionParams.from_json(q.to_json()) == q
