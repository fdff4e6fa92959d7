"""Deep Gradient Compression (algorithms.md section 2) with DGC's defaults: keep 0.1% of each
tensor of more than one dimension, fp32 values and int64 indices, no sparsity warm-up (wm5.py
adds it), momentum correction with the optimizer's momentum and momentum factor masking."""
from dgc_config import Config, configs

configs.train.dgc = True
configs.train.compression = Config(name="dgc")
configs.train.compression.compress_ratio = 0.001  # the kept fraction r
configs.train.compression.sample_ratio = 0.01
configs.train.compression.strided_sample = True
configs.train.compression.compress_upper_bound = 1.3
configs.train.compression.compress_lower_bound = 0.8
configs.train.compression.max_adaptation_iters = 10
configs.train.compression.resample = True
configs.train.compression.fp16_values = False
configs.train.compression.int32_indices = False
configs.train.compression.warmup_epochs = -1  # -1 or 0: no sparsity warm-up
configs.train.compression.warmup_coeff = None  # per-epoch kept fractions of the warm-up

configs.train.compression.memory = Config(name="dgc_sgd_memory")
configs.train.compression.memory.momentum = configs.train.optimizer.momentum
configs.train.compression.memory.nesterov = configs.train.optimizer.nesterov
configs.train.compression.memory.momentum_masking = True
configs.train.compression.memory.gradient_clipping = None  # a max L2 norm (clipped to it / sqrt(workers))
