"""The cases of test_fsdp.py's launch: the models' policies, the codecs each part runs under
which of them, and how the oracle rounds each reduce dtype."""
import numpy as np
import torch

from fsdp_bytes import THC

WIDE = [(256, 128), (256,), (256, 256), (256,), (128, 256), (128,)]  # fsdp_job.WIDE's parameters, sharded on dim 0
# fully_shard's options of the jobs' extra models (fsdp_job.POLICIES): bf16 reduced in f32 or bf16, CPU offload
POLICIES = ["bf16", "bf16r", "offload"]
# the codec runs' models also: float16 parameters reduced in float16, float64 parameters (reduced in float64)
CODEC_POLICIES = POLICIES + ["f16r", "fp64"]
# the exchange's float32 average rounded into a half reduce dtype (as float32); float64: none
ROUNDED = {"bf16r": lambda x: torch.from_numpy(x).to(torch.bfloat16).float().numpy(),
           "f16r": lambda x: x.astype(np.float16).astype(np.float32)}
# the in-host step's output: a sum under the float16 and float64 reduce dtypes (FSDP2 pre-divides
# by 2): the average times the shard group's 2 in that dtype (exact)
IN_HOST_ROUNDED = {"bf16r": ROUNDED["bf16r"], "fp64": lambda x: x * 2,
                   "f16r": lambda x: (x.astype(np.float16) * np.float16(2)).astype(np.float32)}
ITEMSIZE = {"bf16r": 2, "f16r": 2, "fp64": 8}  # the reduce dtype's bytes an element, 4 if not here
# the other codecs on the replicate hook, each a part of the first launch (its policies' models alone,
# 2 steps): element-wise through their default reducer, thc and PowerSGD in float32 phases; each
# also under CPU offload
DTYPE_CODECS = {"onebit": ({"compressor": "onebit", "scaling": True, "ef": "vanilla"}, ["f16r", "bf16r", "fp64", "offload"]),
                "randomk": ({"compressor": "randomk", "k": 0.25}, ["f16r", "fp64", "offload"]),
                "dithering": ({"compressor": "dithering", "k": 4}, ["bf16r", "fp64", "offload"]),
                "qsgd": ({"compressor": "qsgd", "levels": 4}, ["f16r", "fp64", "offload"]),
                "dgc": ({"compressor": "dgc", "k": 0.25, "mu": 0.9}, ["bf16r", "fp64", "offload"]),
                "powersgd": ({"compressor": "powersgd", "rank": 2}, ["f16r", "bf16", "bf16r", "offload"]),
                "thc": (THC, ["f16r", "bf16", "fp64", "offload"]),
                **{name: ({"compressor": name}, ["f16r", "bf16r", "offload"])
                   for name in ("terngrad", "signnorm", "adaptive_threshold", "sign")},
                "threshold": ({"compressor": "threshold", "threshold": 1e-3}, ["f16r", "bf16r", "offload"])}
PHASED = ("powersgd", "thc")  # compressors summed in phases (comm/phased.py): fsdp_inhost_oracle.expected_phased_call
# the in-host step (shard_compression_params) with codecs other than top-k + EF, each a part of the
# first launch (2 steps; None: the plain float32 model), dense across replicas
IN_HOST_CODECS = {"onebit": (DTYPE_CODECS["onebit"][0], [None, "bf16r", "offload"]),
                  "dithering": (DTYPE_CODECS["dithering"][0], ["f16r"]),
                  "randomk": (DTYPE_CODECS["randomk"][0], ["fp64"]),
                  "sign": ({"compressor": "sign"}, [None]),
                  "thc": (THC, [None]), "powersgd": (DTYPE_CODECS["powersgd"][0], [None])}
DENSE_STEPS = 10  # issue 42: the dense hooks equal native HSDP after 10 steps
REFUSED = {("qsgd", "fp64"): "QSGD: float32 or float16 partitions only, got float64",  # the codec's own words
           ("dgc", "fp64"): "DGC: float32 or float16 partitions only, got float64"}


def check_reduce_dtypes(got, before, after):
    """The hooks (or reduce-scatters) got float32 under the float32 reduce dtype, bfloat16 and
    float16 under theirs (recorded widened), float64 with float64 parameters, whose average kept
    float64's bits (not float32's)."""
    low_bits = {policy: got[0][f"{policy}/{before}"].view(np.uint32) & 0xFFFF for policy in ("bf16", "bf16r")}
    assert low_bits["bf16"].any() and not low_bits["bf16r"].any()
    halves = {policy: got[0][f"{policy}/{before}"] for policy in ("bf16", "f16r")}
    assert np.array_equal(halves["f16r"].astype(np.float16).astype(np.float32), halves["f16r"])
    assert not np.array_equal(halves["bf16"].astype(np.float16).astype(np.float32), halves["bf16"])
    wide = got[0][f"fp64/{after}"]
    assert wide.dtype == np.float64 and not np.array_equal(wide.astype(np.float32).astype(np.float64), wide)
