"""Convolutional classifiers: a small Conv+BN+ReLU net and a ResNet-18-shaped network.

Written here rather than taken from torchvision, which is not a dependency (and whose PyPI wheel does not
import beside CPU builds of torch).
"""

from __future__ import annotations

import torch
from torch import nn


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """Conv+BN+ReLU blocks, global average pool, linear head. Input ``[B, C, H, W]``."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for i in range(depth):
            cout = width * (2 ** min(i, 2))
            layers.append(conv_bn_relu(cin, cout, stride=2 if i > 0 else 1))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.down(x))


class ResNet(nn.Module):
    """ResNet-18 layout (2-2-2-2 basic blocks). Input ``[B, 3, 224, 224]`` by default."""

    def __init__(
        self, in_channels: int = 3, num_classes: int = 1000, blocks: tuple[int, ...] = (2, 2, 2, 2), width: int = 64
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        stages: list[nn.Module] = []
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                stages.append(BasicBlock(cin, cout, stride=2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def small_cnn(**kw: object) -> SmallCNN:
    return SmallCNN(**kw)  # type: ignore[arg-type]


def resnet18(**kw: object) -> ResNet:
    return ResNet(**kw)  # type: ignore[arg-type]
