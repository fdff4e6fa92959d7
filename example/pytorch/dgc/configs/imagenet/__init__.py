"""ImageNet as class folders (train/<wnid>/*.JPEG, val/<wnid>/*.JPEG under dataset.root):
90 epochs of batch 32 per worker, lr 0.0125 x workers after a 5-epoch warm-up, cosine."""
from dgc_config import Config, configs

configs.dataset = Config(name="imagenet", root="./data/imagenet", num_classes=1000, image_size=224)
configs.train.num_epochs = 90
configs.train.batch_size = 32
configs.train.optimizer.lr = 0.0125
configs.train.optimizer.weight_decay = 5e-5
