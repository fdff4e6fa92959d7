"""ImageNet as the usual folder tree (numpy + PIL, no framework): ROOT/train/<wnid>/*.JPEG and
ROOT/val/<wnid>/*.JPEG, the layout of the ILSVRC2012 tarballs once the validation images are
sorted into class folders (what torchvision's ImageFolder and the imagenet18 scripts read).
Class indices are the sorted training folder names; a validation folder unknown to the
training set is an error. Any image PIL opens is accepted; grey and CMYK images become RGB.

Training images get a random-resized crop (area in [min_scale, 1], aspect ratio in [3/4, 4/3])
and a random horizontal flip; validation images are resized (shorter side size * 1.14) and
center-cropped. Batches are uint8 N x 3 x size x size; ``normalize`` makes them float32.
"""
import math
import os

import numpy as np

EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".ppm", ".webp")
MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)
VAL_RESIZE = 1.14  # 256 / 224


def scan(root, split, classes=None):
    """(classes, [(path, label), ...]) of ROOT/split; ``classes`` from the training split."""
    folder = os.path.join(os.path.expanduser(root), split)
    if not os.path.isdir(folder):
        raise SystemExit(f"no ImageNet {split} folder at {folder} (want {split}/<wnid>/*.JPEG under the "
                         "data directory; nothing is downloaded)")
    found = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    if classes is None:
        classes = found
    index = {name: i for i, name in enumerate(classes)}
    unknown = [d for d in found if d not in index]
    if unknown:
        raise SystemExit(f"{folder}: class folder {unknown[0]!r} is not in the training set")
    items = []
    for name in found:
        for entry in sorted(os.listdir(os.path.join(folder, name))):
            if entry.lower().endswith(EXTENSIONS):
                items.append((os.path.join(folder, name, entry), index[name]))
    if not items:
        raise SystemExit(f"{folder}: no images in its class folders")
    return classes, items


def _open(path):
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise SystemExit(f"{path}: not a readable image ({e})") from None


def _to_array(img):
    # C-order CHW: a transposed view would make every batch channels-last, and torch 2.13's
    # oneDNN convolution backward corrupts the heap on channels-last inputs on AVX2-only CPUs
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))


def train_image(path, size, rng, min_scale=0.08):
    """Random-resized crop to size x size and random flip (uint8 3 x size x size)."""
    from PIL import Image
    img = _open(path)
    w, h = img.size
    box = None
    for _ in range(10):
        area = w * h * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            box = (x, y, x + cw, y + ch)
            break
    if box is None:  # the central square, as torchvision falls back
        side = min(w, h)
        box = ((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side)
    img = img.resize((size, size), Image.BILINEAR, box=box)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return _to_array(img)


def val_image(path, size):
    """Shorter side resized to size * 1.14, then the central size x size (uint8)."""
    from PIL import Image
    img = _open(path)
    w, h = img.size
    short = max(size, int(round(size * VAL_RESIZE)))
    scale = short / min(w, h)
    nw, nh = max(size, int(round(w * scale))), max(size, int(round(h * scale)))
    img = img.resize((nw, nh), Image.BILINEAR)
    x, y = (nw - size) // 2, (nh - size) // 2
    return _to_array(img.crop((x, y, x + size, y + size)))


def normalize(images):
    return (images.astype(np.float32) * np.float32(1 / 255) - MEAN) / STD
