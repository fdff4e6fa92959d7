from dgc_config import configs

configs.train.compression.fp16_values = True
