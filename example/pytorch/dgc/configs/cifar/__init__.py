"""CIFAR-10 from the official python files (cifar-10-batches-py/ under dataset.root): DGC's
recipe, 200 epochs of batch 128 per worker, lr 0.1 x workers after a 5-epoch warm-up, cosine."""
from dgc_config import Config, configs

configs.dataset = Config(name="cifar10", root="./data/cifar10", num_classes=10, image_size=32)
configs.train.num_epochs = 200
configs.train.batch_size = 128
configs.train.optimizer.lr = 0.1
configs.train.optimizer.weight_decay = 1e-4
