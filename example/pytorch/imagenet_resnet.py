"""ImageNet ResNet v1.5 (He et al. 2016; stride 2 in the 3x3 convolution of a bottleneck, as
torchvision and the imagenet18 scripts), written here because torchvision is optional:
resnet18 / resnet34 (basic blocks), resnet50 / resnet101 / resnet152 (bottlenecks).

``width`` is the channels of the stem (64 in the paper; every stage scales with it) so tests can
train a small one. ``init_bn0`` starts the last BatchNorm scale of every residual branch at 0
(Goyal et al. 2017), which is what the imagenet18 scripts' --init-bn0 does.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from resnet_layouts import LAYOUTS  # noqa: F401


class Basic(nn.Module):
    expansion = 1

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.last_bn = self.bn2
        self.shortcut = shortcut(cin, planes * self.expansion, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.last_bn = self.bn3
        self.shortcut = shortcut(cin, planes * 4, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


def shortcut(cin, cout, stride):
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, arch, classes, width=64, init_bn0=False):
        super().__init__()
        if arch not in LAYOUTS:
            raise SystemExit(f"--arch {arch!r}: one of {', '.join(LAYOUTS)}")
        if width < 1 or classes < 1:
            raise SystemExit(f"--width and the number of classes must be >= 1, got {width} and {classes}")
        kind, counts = LAYOUTS[arch]
        block = Basic if kind == "basic" else Bottleneck
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], width
        for stage, count in enumerate(counts):
            planes = width * 2 ** stage
            for i in range(count):
                layers.append(block(cin, planes, 2 if stage > 0 and i == 0 else 1))
                cin = planes * block.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if init_bn0:
            for b in layers:
                nn.init.zeros_(b.last_bn.weight)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def batchnorm_parameters(model):
    """Names of the BatchNorm scales and shifts (what --no-bn-wd exempts from weight decay)."""
    return {f"{mod_name}.{p_name}" if mod_name else p_name
            for mod_name, mod in model.named_modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)
            for p_name, _ in mod.named_parameters(recurse=False)}
