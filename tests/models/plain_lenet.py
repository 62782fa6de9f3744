"""A LeNet-5 as a PyTorch user writes it, in a file that imports torch alone (its trained
weights load back into it in a process that never imports netpart)."""

import torch
from torch import nn


class LeNet5(nn.Module):
    """LeCun et al. 1998: tanh, average pooling, three fully connected layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.pool = nn.AvgPool2d(2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.tanh(self.conv1(x)))
        x = self.pool(torch.tanh(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.tanh(self.fc1(x))
        return self.fc3(torch.tanh(self.fc2(x)))
