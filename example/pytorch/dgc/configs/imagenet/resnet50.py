from dgc_config import Config, configs

configs.train.optimizer.weight_decay = 1e-4
configs.train.optimizer.nesterov = True
configs.train.optimize_bn_separately = True

# width: channels of the stem (64: the paper's ResNet-50; smaller for quick runs)
configs.model = Config(name="resnet50", num_classes=configs.dataset.num_classes, zero_init_residual=True,
                       width=64)
