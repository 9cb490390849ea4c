"""Small models of every kind the controller must handle (shared by the controller tests)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, d_hidden: int = 128, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class CNN(nn.Module):
    """Conv, BatchNorm, residual connections, in-place ReLU, max-pool and dropout."""

    def __init__(self, c: int = 16, n_classes: int = 10, in_ch: int = 1) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_ch, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.block1 = ResBlock(c)
        self.pool = nn.MaxPool2d(2)
        self.block2 = ResBlock(c)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(c, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.stem(x)))
        x = self.pool(self.block1(x))
        x = self.block2(x)
        x = x.mean(dim=(2, 3))
        return self.head(self.drop(x))


class TransformerBlock(nn.Module):
    """Embedding, self-attention with softmax, LayerNorm and GELU."""

    def __init__(self, vocab: int = 100, d: int = 64, heads: int = 4, n_out: int = 100) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.ff2 = nn.Linear(4 * d, d)
        self.out = nn.Linear(d, n_out)
        self.heads = heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.ff2(self.gelu(self.ff1(self.ln2(x))))
        return self.out(x)


class LSTMModel(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 64, n_out: int = 4) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, d_hidden, batch_first=True)
        self.head = nn.Linear(d_hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` layout (7x7 stem, max-pool, 4 stages of 2 blocks) at any width."""

    def __init__(self, num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages = []
        c_in = width
        for i, c in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stages.append(nn.Sequential(BasicBlock(c_in, c, 1 if i == 0 else 2), BasicBlock(c, c)))
            c_in = c
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def batch_for(model: nn.Module, n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random input and integer targets that suit ``model``."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, MLP):
        return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
    if isinstance(model, CNN):
        return torch.randn(n, 1, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)
    if isinstance(model, TransformerBlock):
        tokens = torch.randint(0, 100, (n, 16), generator=g)
        return tokens, torch.randint(0, 100, (n, 16), generator=g)
    if isinstance(model, LSTMModel):
        return torch.randn(n, 12, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    raise TypeError(type(model))


def loss_for(model: nn.Module, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if isinstance(model, TransformerBlock):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(out, y)
