from dgc_config import configs

# the kept fraction of the first five epochs: 25%, 6.3%, 1.5%, 0.4%, then 0.1%
configs.train.compression.warmup_epochs = 5
configs.train.compression.warmup_coeff = [0.25, 0.063, 0.015, 0.004, 0.001]
