"""Regression on tabular data, the test RMSE as its metric: a task for the scripts
(docs/your-own-task.md). Rows of 8 numbers and a value to predict, made up here.

    torchrun --standalone --nproc-per-node=2 torchrun_ddp.py --task tasks/regression.py

The optimizer and its schedule stay common.py's (Adam with a warmup), at this task's LR.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

FEATURES = 8


def add_task_flags(parser):
    parser.add_argument("--samples", type=int, default=4096, help="training rows")
    parser.set_defaults(lr=0.003, batch_size=128)


def make_datasets(args):  # made-up rows: a noisy function of 8 features
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples + 1000, FEATURES, generator=g)
    y = torch.sin(x[:, 0]) + x[:, 1] * x[:, 2] + 0.1 * torch.randn(len(x), generator=g)
    return (TensorDataset(x[:args.samples], y[:args.samples]),
            TensorDataset(x[args.samples:], y[args.samples:]))


def make_model(args):  # one output per row: the predicted value
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(64, 1), nn.Flatten(0))


def loss_fn(output, target):
    return F.mse_loss(output, target)


def evaluate_batch(output, target):  # sums over a test batch, added over all of them
    return {"squared_error": ((output.float() - target) ** 2).sum(),
            "rows": torch.tensor(len(target))}


def summarize(sums):
    return {"test_rmse": (sums["squared_error"] / sums["rows"]) ** 0.5}
