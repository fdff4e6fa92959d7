from dgc_config import configs

configs.train.compression.warmup_epochs = 0
