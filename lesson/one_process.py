"""The lesson, first half: a plain training loop in one process. Its DDP version is ddp.py
beside it, and `diff lesson/one_process.py lesson/ddp.py` is all that DDP changes (README.md).

    python lesson/one_process.py --epochs 2 --checkpoint lesson.pt
"""
import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import common  # noqa: E402  (one folder up: the task, MNIST, and the helpers)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--checkpoint", help="where to save the model after every epoch")
    common.add_task_flags(p)  # --data-dir, --dummy
    # The optimizer recipe that common.make_optimizer and make_scheduler read: the scripts'
    # defaults for --lr, --lr-scaling and --warmup-epochs (docs/flags.md).
    p.set_defaults(lr=0.01, lr_scaling="sqrt", warmup_epochs=0.2)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    common.prepare_data(args)  # MNIST downloads to --data-dir if it is not there

    train_set, test_set = common.make_datasets(args)
    batch_size = args.batch_size
    loader = DataLoader(train_set, batch_size, shuffle=True, collate_fn=common.collate)
    test_loader = DataLoader(test_set, batch_size, collate_fn=common.collate)

    torch.manual_seed(0)  # the initial weights
    model = common.make_model(args).to(device)
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args, len(loader))

    for epoch in range(args.epochs):
        model.train()
        totals = torch.zeros(2, device=device)  # the loss summed over the samples, the samples
        for inputs, target in loader:
            inputs, target = inputs.to(device), target.to(device)
            loss = common.loss_fn(model(inputs), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
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
