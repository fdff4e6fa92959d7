"""train_gluon_imagenet_byteps_gc.py's data, sharded over the workers: RecordIO files read by
mx.io.ImageRecordIter (``RecordData``), or an image folder read by ImageFolderDataset
(``FolderData``), each with gluoncv's augmentation. Both give (data, label, real samples)
batches and the record counts the script sizes its epochs by.
"""
import math
import os

import mxnet as mx
from mxnet import gluon
from mxnet.gluon.data.vision import transforms

MEAN_RGB = [123.68, 116.779, 103.939]
STD_RGB = [58.393, 57.12, 57.375]
JITTER, LIGHTING = 0.4, 0.1


def count_records(idx_path):
    with open(idx_path) as f:
        return sum(1 for line in f if line.strip())


def smallest_part(records, parts):
    """Records in the smallest part when ImageRecordIter splits an indexed file: the first
    parts get ceil(records / parts) each, the last what is left."""
    per = -(-records // parts)
    return max(0, records - (parts - 1) * per)


def existing(path, flag):
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise SystemExit(f"{flag}: no file {path}")
    return path


class RecordData:
    """ImageRecordIter, sharded with part_index=rank, num_parts=size."""

    def __init__(self, args, rank, size):
        self.rec_train = existing(args.rec_train, "--rec-train")
        self.rec_train_idx = existing(args.rec_train_idx, "--rec-train-idx")
        self.rec_val = existing(args.rec_val, "--rec-val")
        self.rec_val_idx = existing(args.rec_val_idx, "--rec-val-idx")
        self.args, self.rank, self.size = args, rank, size
        records = count_records(self.rec_train_idx)
        self.train_records = records
        self.train_share = smallest_part(records, size)
        self.val_records = count_records(self.rec_val_idx)
        if smallest_part(self.val_records, size) < args.batch_size:
            # ImageRecordIter refuses a part with fewer images than a batch
            raise SystemExit(f"{self.rec_val}: {self.val_records} records leave a worker fewer "
                             f"than --batch-size {args.batch_size} validation images")
        common_args = dict(preprocess_threads=max(1, args.num_workers), batch_size=args.batch_size,
                           data_shape=(3, args.input_size, args.input_size),
                           mean_r=MEAN_RGB[0], mean_g=MEAN_RGB[1], mean_b=MEAN_RGB[2],
                           std_r=STD_RGB[0], std_g=STD_RGB[1], std_b=STD_RGB[2],
                           num_parts=size, part_index=rank)
        self.common = common_args
        self.train_iter = mx.io.ImageRecordIter(
            path_imgrec=self.rec_train, path_imgidx=self.rec_train_idx, shuffle=True,
            rand_mirror=True, random_resized_crop=True, max_aspect_ratio=4. / 3.,
            min_aspect_ratio=3. / 4., max_random_area=1, min_random_area=0.08,
            brightness=JITTER, saturation=JITTER, contrast=JITTER, pca_noise=LIGHTING,
            seed=args.seed + rank, round_batch=False, **common_args)

    def train_batches(self):
        """(data, label, real samples) batches; the caller takes whole-batch steps only.
        round_batch=False: with MXNet's default (True) the iterator, which reads ahead, wraps
        into the next epoch at the end of the shard, and after reset() the next epoch starts
        where the wrap ended, with fewer whole batches."""
        self.train_iter.reset()
        for batch in self.train_iter:
            yield batch.data[0], batch.label[0], self.args.batch_size - batch.pad

    def val_batches(self):
        # a new iterator each time: after a padded last batch, ImageRecordIter's next epoch
        # starts where the padding wrapped to, and would skip images
        resize = int(math.ceil(self.args.input_size / self.args.crop_ratio))
        val_iter = mx.io.ImageRecordIter(path_imgrec=self.rec_val, path_imgidx=self.rec_val_idx,
                                         shuffle=False, resize=resize, **self.common)
        for batch in val_iter:
            yield batch.data[0], batch.label[0], self.args.batch_size - batch.pad


class Subset(gluon.data.Dataset):
    """Every ``step``-th item of ``dataset`` from ``start`` (an interleaved shard)."""

    def __init__(self, dataset, start, step):
        self.dataset, self.indices = dataset, range(start, len(dataset), step)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.dataset[self.indices[i]]


class FolderData:
    """ImageFolderDataset over --data-dir/{train,val}, sharded by rank."""

    def __init__(self, args, rank, size):
        root = os.path.expanduser(args.data_dir)
        self.args = args
        datasets = {}
        for split in ("train", "val"):
            path = os.path.join(root, split)
            if not os.path.isdir(path):
                raise SystemExit(f"--data-dir: no folder {path} (want {split}/<class>/<image>; "
                                 "or use --use-rec with the --rec-* files)")
            datasets[split] = gluon.data.vision.ImageFolderDataset(path, flag=1)
            if len(datasets[split].synsets) > args.num_classes:
                raise SystemExit(f"{path}: {len(datasets[split].synsets)} class folders but "
                                 f"--num-classes {args.num_classes}")
        train, val = datasets["train"], datasets["val"]
        if train.synsets != val.synsets:  # the label of a class is its place in the sorted list
            raise SystemExit(f"--data-dir: train/ and val/ must have the same class folders "
                             f"({len(train.synsets)} and {len(val.synsets)} here)")
        self.train_records = len(train)
        self.train_share = len(train) // size
        self.val_records = len(val)
        normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        resize = int(math.ceil(args.input_size / args.crop_ratio))
        transform_train = transforms.Compose([
            transforms.RandomResizedCrop(args.input_size),
            transforms.RandomFlipLeftRight(),
            transforms.RandomColorJitter(brightness=JITTER, contrast=JITTER, saturation=JITTER),
            transforms.RandomLighting(LIGHTING),
            transforms.ToTensor(),
            normalize,
        ])
        transform_test = transforms.Compose([
            transforms.Resize(resize, keep_ratio=True),
            transforms.CenterCrop(args.input_size),
            transforms.ToTensor(),
            normalize,
        ])
        # Compose hybridizes ToTensor + Normalize; two loader threads building that graph at
        # once race on Gluon's name scope (AttributeError '__exit__'): build it here, once
        for transform, records in ((transform_train, train), (transform_test, val)):
            if len(records):
                transform(records[0][0])
        # threads, not processes: forking a process with the worker core's threads and
        # sockets is not safe
        loader = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                      thread_pool=args.num_workers > 0)
        self.train_loader = gluon.data.DataLoader(
            Subset(train, rank, size).transform_first(transform_train),
            shuffle=True, last_batch="discard", **loader)
        self.val_loader = gluon.data.DataLoader(
            Subset(val, rank, size).transform_first(transform_test),
            shuffle=False, last_batch="keep", **loader)

    def train_batches(self):
        for data, label in self.train_loader:
            yield data, label, data.shape[0]

    def val_batches(self):
        for data, label in self.val_loader:
            yield data, label, data.shape[0]
