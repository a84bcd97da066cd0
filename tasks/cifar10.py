"""CIFAR-10 with torchvision's ResNet-18: a task for the scripts (docs/your-own-task.md).

    torchrun --standalone --nproc-per-node=4 torchrun_ddp.py --task tasks/cifar10.py --workers 4
    python spawn_ddp.py --task tasks/cifar10.py --dummy --workers 2 --batch-size 64   # no download

It defines the names of the seam that differ from MNIST's; the rest (collate, the schedule,
evaluate_batch and summarize) stay common.py's.
"""
import torch
import torch.nn.functional as F
import torchvision
from torchvision import transforms as T

from common import peak_lr

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def add_task_flags(parser):
    parser.add_argument("--data-dir", default="./data", help="CIFAR-10 root; downloaded there once")
    parser.add_argument("--dummy", action="store_true", help="random images of CIFAR-10's shape")
    parser.set_defaults(lr=0.1, lr_scaling="linear", channels_last=True)  # SGD at batch 256


def prepare_data(args):
    if not args.dummy:
        for train in (True, False):
            torchvision.datasets.CIFAR10(args.data_dir, train=train, download=True)


def make_datasets(args):
    normalize = [T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]
    augment = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), *normalize])
    plain = T.Compose(normalize)
    if args.dummy:  # 512 training and 128 test images, made up: for trying the set-up
        return (torchvision.datasets.FakeData(512, (3, 32, 32), 10, transform=augment),
                torchvision.datasets.FakeData(128, (3, 32, 32), 10, transform=plain,
                                              random_offset=512))
    return (torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=augment),
            torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=plain))


def make_model(args):
    return torchvision.models.resnet18(num_classes=10)


def loss_fn(output, target):
    return F.cross_entropy(output, target)


def make_optimizer(model, args):
    return torch.optim.SGD(model.parameters(), lr=peak_lr(args), momentum=0.9, weight_decay=5e-4)
