"""The demo's issue-11 rows (mnist_demo.py --codec-rows): DGC, TernGrad, QSGD and threshold-v,
and top-k applied per tensor (layer-wise) or once over the whole model (entire-model) at two
kept fractions, the study's grid in algorithms.md sections 2-3.

As in the layer-wise study there is no error feedback (the optimizer's momentum 0.9 applies to
the averaged gradient; DGC moves it into its momentum correction), and every tensor is
compressed: these rows run with BYTEPS_MIN_COMPRESS_BYTES=0, so the MLP's four tensors (two
weights, two biases) all go through the codec, where the other rows compress only the 784x128
weight. DGC sends its 1-D tensors (the biases) dense and warms its sparsity up over the first
5 epochs (k^((e+1)/5): 25%, 6.3%, 1.6%, 0.4%, 0.1%); the worker tells it the epoch.

How the server reduces differs, and it matters for the comparison: the layer-wise rows use the
codec's default reducer, BytePS's ``recompress`` (the server decodes, sums and compresses the
sum again with the same codec: a second top-k, threshold or quantization on the pull), while
DGC and the entire-model rows pull ``lossless`` (the sum of the workers' messages, as the
study's and DGC's allgather). bps_gc.torch has no compression_params key to choose the
reducer of a layer-wise tensor.
"""

# every row runs with this environment added (read by each worker at bps_gc init)
ROW_ENV = {"BYTEPS_MIN_COMPRESS_BYTES": "0"}

# name -> (description, compression_params)
CODEC_ROWS = {
    "dgc": ("DGC 0.1%, warm-up 5 epochs, fp16 values",
            {"compressor": "dgc", "k": 0.001, "warmup_epochs": 5, "fp16_values": True, "momentum": "nesterov"}),
    "terngrad": ("TernGrad, layer-wise", {"compressor": "terngrad"}),
    "qsgd": ("QSGD Q=255, layer-wise", {"compressor": "qsgd", "levels": 255}),
    "thresholdv": ("threshold-v v=0.001, layer-wise", {"compressor": "threshold", "threshold": 0.001}),
    "topk-lw-1": ("top-1% layer-wise", {"compressor": "topk", "k": 0.01}),
    "topk-em-1": ("top-1% entire-model", {"compressor": "topk", "k": 0.01, "granularity": "entiremodel"}),
    "topk-lw-10": ("top-10% layer-wise", {"compressor": "topk", "k": 0.1}),
    "topk-em-10": ("top-10% entire-model", {"compressor": "topk", "k": 0.1, "granularity": "entiremodel"}),
}
