"""Models as a PyTorch user writes them (issues 78 and 79): a LeNet-5, a VGG-style CNN, the
DistBelief locally connected network built from netpart.nn, an MLP, residual networks with
and without batch norm, and a CIFAR ResNet-20 as torchvision writes its ResNets; each with the
one example's shape netpart reads it at (`--input`)."""

import torch
from torch import nn
from torch.nn import functional as F

from netpart.nn import LocalContrastNorm, LocallyConnected2d

from .plain_lenet import LeNet5


class VGGish(nn.Module):
    """Two VGG blocks of 3x3 convolutions at 3x32x32 (one of them 3x5, wider than tall),
    then a classifier with dropout (narrow widths)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, (3, 5), padding=(1, 2)),
            nn.LeakyReLU(0.1),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False),
            nn.GELU(),
            nn.MaxPool2d(2, stride=2),
            nn.Dropout(0.25),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * 8 * 8, 32),
            nn.SiLU(),
            nn.Dropout(0.5),
            nn.Linear(32, 10),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def distbelief():
    """Le et al. 2012's layer stack: untied filters, L2 pooling (torch's LPPool2d(2)), local
    contrast norm."""
    return nn.Sequential(
        LocallyConnected2d(3, 8, (16, 16), kernel_size=5),
        nn.Sigmoid(),
        nn.LPPool2d(2, 2),
        LocalContrastNorm(3),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 10),
    )


def rectangles():
    """Windows, strides and paddings that differ between the axes, on a spectrogram-shaped
    input (1x20x32), as audio models take them."""
    return nn.Sequential(
        nn.Conv2d(1, 4, (3, 5), stride=(1, 2), padding=(1, 0)),  # 4x20x14
        nn.ReLU(),
        nn.MaxPool2d((2, 1)),  # 4x10x14
        LocallyConnected2d(4, 3, (10, 14), kernel_size=(3, 2), stride=(1, 2)),  # 3x8x7
        nn.Tanh(),
        nn.AvgPool2d((2, 3), stride=2, padding=(0, 1)),  # 3x4x4
        nn.LPPool2d(2, (1, 2)),  # 3x4x2
        nn.Flatten(),
        nn.Linear(3 * 4 * 2, 5),
    )


class MLP(nn.Module):
    """Features in, classes out (the speech model's shape, small)."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(40, 64)
        self.out = nn.Linear(64, 6)

    def forward(self, x):
        return self.out(F.leaky_relu(self.hidden(x), negative_slope=0.2))


# name -> (the module's factory, --input)
MODELS = {
    "LeNet5": (LeNet5, "1x28x28"),
    "VGGish": (VGGish, "3x32x32"),
    "distbelief": (distbelief, "3x16x16"),
    "MLP": (MLP, "40"),
    "rectangles": (rectangles, "1x20x32"),
}


class Skip(nn.Module):
    """A conv whose output a second conv reads and the addition reads again (a residual
    connection around a bias-less conv), at 3x8x8."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        y = self.a(x).relu()
        return self.fc((self.b(y) + y).relu().flatten(1))


class NormedSkip(nn.Module):
    """A residual block with batch norm after each conv and a 1x1 stride-2 projection
    shortcut, then a batch-normed classifier, at 3x8x8 (torchvision's block, small)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(4)
        self.conv1 = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.downsample = nn.Sequential(nn.Conv2d(4, 6, 1, stride=2, bias=False), nn.BatchNorm2d(6))
        self.fc = nn.Linear(6 * 4 * 4, 3)
        self.head = nn.BatchNorm1d(3)

    def forward(self, x):
        x = F.relu(self.bn0(self.stem(x)))
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        out = F.relu(out + self.downsample(x))
        return self.head(self.fc(out.flatten(1)))


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, as written: conv-bn-relu-conv-bn, a 1x1 conv + bn projection
    where the shape changes, the addition, a relu."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet20(nn.Module):
    """He et al.'s CIFAR ResNet-20 (three stages of three basic blocks, projection
    shortcuts), written as torchvision writes its ResNets; its widths a parameter."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        stages, cin = [], width
        for s, w in enumerate((width, 2 * width, 4 * width)):
            blocks = []
            for b in range(3):
                blocks.append(BasicBlock(cin, w, 2 if s and not b else 1))
                cin = w
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AvgPool2d(8)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def narrow_resnet20() -> ResNet20:
    """ResNet-20 at widths 8, 16 and 32 (68,786 parameters)."""
    return ResNet20(width=8)
