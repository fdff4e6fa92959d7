"""Settings every run starts from (DGC's configs/__init__.py layout; the values are this
script's). The data set, model and training length come from configs/cifar or configs/imagenet,
DGC from configs/dgc."""
from dgc_config import Config, configs

configs.seed = 42
# auto: cuda:LOCAL_RANK where CUDA is available, else the CPU; --devices gpu|cpu (DGC's flag) and
# --device (auto, cpu, cuda, cuda:N) replace it
configs.device = "auto"
configs.data = Config(num_threads_per_worker=4)  # loader threads (and torch threads unless OMP_NUM_THREADS)

configs.train = Config()
configs.train.num_epochs = None  # set by the data set's configs
configs.train.batch_size = None  # per worker
configs.train.num_batches_per_step = 1
configs.train.max_steps_per_epoch = None  # bps_gc's addition: at most this many steps (quick runs)
configs.train.dgc = False
configs.train.compression = Config(name="none")
configs.train.criterion = "cross_entropy"
configs.train.optimizer = Config(name="sgd", lr=None, momentum=0.9, weight_decay=0.0, nesterov=False)
configs.train.optimize_bn_separately = False  # True: no weight decay on BatchNorm parameters
# the rate is lr * workers; the first warmup_lr_epochs ramp it linearly up from lr, per step
configs.train.warmup_lr_epochs = 5
configs.train.schedule_lr_per_epoch = True  # after warm-up: the cosine steps once per epoch
configs.train.scheduler = Config(name="cosine")  # over num_epochs - warmup_lr_epochs epochs, to 0
configs.train.metric = "acc/test_top1"
configs.train.meters = ["acc/{}_top1", "acc/{}_top5"]
# bps_gc's addition: None (float32), "float16" (autocast and a gradient scaler) or "bfloat16"
# (autocast); DGC's configs/dgc/fp16.py is its fp16 *values* on the wire, which this does not change
configs.train.mixed_precision = None
configs.train.keep_checkpoints = 3  # e<epoch>-r<rank>.pth files kept besides latest and best
