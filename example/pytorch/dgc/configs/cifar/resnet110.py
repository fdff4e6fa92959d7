from dgc_config import Config, configs

configs.model = Config(name="resnet110", num_classes=configs.dataset.num_classes)
