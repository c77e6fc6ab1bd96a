"""A small ResNet for small images (MNIST-sized, or the 8x8 digits): a 3x3 stem, residual stages,
global average pooling. Takes raw pixel values (0..255) and scales them itself, so the saved network
needs no preprocessing beside decoding."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self, *, channels: int, num_classes: int, widths: list[int], depth: int, dropout: float):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks: list[nn.Module] = []
        in_channels = widths[0]
        for stage, width in enumerate(widths):
            for block in range(depth):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(BasicBlock(in_channels, width, stride))
                in_channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(in_channels, num_classes))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels``: float [B, C, H, W] with values 0..255."""
        return self.head(self.blocks(self.stem(pixels / 127.5 - 1.0)))
