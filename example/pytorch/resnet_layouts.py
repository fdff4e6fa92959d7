"""The ImageNet ResNets' layouts (imagenet_resnet.py builds them): without torch, so that a
script can name them in its flags before it imports torch (benchmark_synthetic.py's driver)."""
LAYOUTS = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet34": ("basic", (3, 4, 6, 3)),
           "resnet50": ("bottleneck", (3, 4, 6, 3)), "resnet101": ("bottleneck", (3, 4, 23, 3)),
           "resnet152": ("bottleneck", (3, 8, 36, 3))}
