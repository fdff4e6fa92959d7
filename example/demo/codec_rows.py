"""The demo's issue-11 rows (mnist_demo.py --codec-rows): DGC, TernGrad, QSGD and threshold-v,
TernGrad, QSGD and top-k (at two kept fractions) applied per tensor (layer-wise) or once over the
whole model (entire-model): the study's grid in algorithms.md sections 2-3.

As in the layer-wise study there is no error feedback (the optimizer's momentum 0.9 applies to
the averaged gradient; DGC moves it into its momentum correction), and every tensor is
compressed: these rows run with BYTEPS_MIN_COMPRESS_BYTES=0, so the MLP's four tensors (two
weights, two biases) all go through the codec, where the other rows compress only the 784x128
weight. DGC sends its 1-D tensors (the biases) dense and warms its sparsity up over the first
5 epochs (k^((e+1)/5): 25%, 6.3%, 1.6%, 0.4%, 0.1%); the worker tells it the epoch.

Every row's servers but thc's reduce with ``lossless`` (thc's add its integer codes, exactly): the pull is the exact sum of the workers'
decoded messages, as the study's and DGC's allgather (the layer-wise rows set ``reducer``;
BytePS's default ``recompress`` would compress the sum again, a second top-k, threshold or
quantization on the pull, and so favour the entire-model rows).
"""

# every row runs with this environment added (read by each worker at bps_gc init)
ROW_ENV = {"BYTEPS_MIN_COMPRESS_BYTES": "0"}

# name -> (description, compression_params)
CODEC_ROWS = {
    "dgc": ("DGC 0.1%, warm-up 5 epochs, fp16 values",
            {"compressor": "dgc", "k": 0.001, "warmup_epochs": 5, "fp16_values": True, "momentum": "nesterov"}),
    "terngrad": ("TernGrad, layer-wise", {"compressor": "terngrad", "reducer": "lossless"}),
    "qsgd": ("QSGD Q=255, layer-wise", {"compressor": "qsgd", "levels": 255, "reducer": "lossless"}),
    "thresholdv": ("threshold-v v=0.001, layer-wise", {"compressor": "threshold", "threshold": 0.001,
                                                          "reducer": "lossless"}),
    "terngrad-em": ("TernGrad, entire-model", {"compressor": "terngrad", "granularity": "entiremodel"}),
    "qsgd-em": ("QSGD Q=255, entire-model", {"compressor": "qsgd", "levels": 255, "granularity": "entiremodel"}),
    "topk-lw-1": ("top-1% layer-wise", {"compressor": "topk", "k": 0.01, "reducer": "lossless"}),
    "topk-em-1": ("top-1% entire-model", {"compressor": "topk", "k": 0.01, "granularity": "entiremodel"}),
    "topk-lw-10": ("top-10% layer-wise", {"compressor": "topk", "k": 0.1, "reducer": "lossless"}),
    "topk-em-10": ("top-10% entire-model", {"compressor": "topk", "k": 0.1, "granularity": "entiremodel"}),
    # issue 35: summed codes (reducer thc: the servers add them, nothing is decoded there)
    "thc": ("thc 4-bit, stochastic rounding", {"compressor": "thc", "bits": 4}),
    "thc-ef": ("thc 4-bit, error feedback, rotated", {"compressor": "thc", "bits": 4, "feedback": True,
                                                      "rotate": True}),
}
