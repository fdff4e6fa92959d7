from dgc_config import configs

configs.train.compression.int32_indices = True
