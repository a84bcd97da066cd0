"""The lesson, first half: a plain MNIST training loop in one process. Its DDP version is ddp.py
beside it, and `diff lesson/one_process.py lesson/ddp.py` is all that DDP changes (README.md).
Both need torch and torchvision only: nothing else of this repository.

    python lesson/one_process.py --epochs 2 --checkpoint lesson.pt
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchvision.datasets import MNIST


class Net(nn.Module):
    """Two convolutions with BatchNorm, whose running statistics are buffers, and a small head.
    No bias in a convolution before BatchNorm: subtracting the batch mean cancels it."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


def mnist(data_dir, train):
    """MNIST's training or test set as two tensors in memory, normalised (downloaded if missing)."""
    data = MNIST(data_dir, train=train, download=True)
    return TensorDataset((data.data.float().unsqueeze(1) / 255 - 0.1307) / 0.3081, data.targets)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-dir", default="./data", help="MNIST's folder (torchvision's layout)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--checkpoint", help="where to save the model after every epoch")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    train_set, test_set = mnist(args.data_dir, train=True), mnist(args.data_dir, train=False)
    batch_size = args.batch_size
    loader = DataLoader(train_set, batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size)

    torch.manual_seed(0)  # the initial weights
    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    for epoch in range(args.epochs):
        model.train()
        totals = torch.zeros(2, device=device)  # the loss summed over the samples, the samples
        for inputs, target in loader:
            inputs, target = inputs.to(device), target.to(device)
            loss = F.cross_entropy(model(inputs), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            totals[0] += loss.detach() * len(target)  # added up on the device: no wait per step
            totals[1] += len(target)
        train_loss = (totals[0] / totals[1]).item()

        model.eval()
        counts = torch.zeros(2, device=device)  # correct predictions, test samples
        with torch.no_grad():
            for inputs, target in test_loader:
                output = model(inputs.to(device))
                counts[0] += (output.argmax(1) == target.to(device)).sum()
                counts[1] += len(target)
        correct, total = counts.tolist()
        report = (f"epoch {epoch + 1} train_loss {train_loss:.4f} test_acc "
                  f"{100 * correct / total:.4g} correct {correct:.0f} total {total:.0f}")
        if args.checkpoint:
            torch.save({"model": model.state_dict(), "epoch": epoch + 1}, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)  # whole, or the last one
        print(report, flush=True)


if __name__ == "__main__":
    main()
