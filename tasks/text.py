"""Text classification: token sequences of 5 to 60 tokens, samples as dicts (as Hugging Face
datasets return them), a padding collate with an attention mask, and a small Transformer with
dropout: a task for the scripts (docs/your-own-task.md).

    torchrun --standalone --nproc-per-node=2 torchrun_ddp.py --task tasks/text.py --workers 2
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

VOCAB, CLASSES, PAD = 64, 4, 0


def add_task_flags(parser):
    parser.add_argument("--samples", type=int, default=2000, help="training sequences")
    parser.set_defaults(lr=0.003, batch_size=64)


class Sentences(Dataset):
    """Sequences whose label is the token that fills a quarter of the positions or more."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for _ in range(n):
            label = torch.randint(CLASSES, (), generator=g)
            length = int(torch.randint(5, 61, (), generator=g))
            ids = torch.randint(CLASSES + 1, VOCAB, (length,), generator=g)
            ids[torch.rand(len(ids), generator=g) < 0.3] = label + 1
            self.samples.append({"input_ids": ids, "label": int(label)})

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def make_datasets(args):
    return Sentences(args.samples, seed=1), Sentences(301, seed=2)


def collate(samples):
    ids = pad_sequence([s["input_ids"] for s in samples], batch_first=True, padding_value=PAD)
    return {"input_ids": ids, "attention_mask": ids != PAD}, torch.tensor(
        [s["label"] for s in samples])


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, 32), nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.encoder(self.embed(input_ids) + self.position(positions),
                         src_key_padding_mask=~attention_mask)
        mask = attention_mask.unsqueeze(-1)
        return self.head((x * mask).sum(1) / mask.sum(1))


def make_model(args):
    return Classifier()


def loss_fn(output, target):
    return F.cross_entropy(output, target)


def evaluate_batch(output, target):
    return {"correct": (output.argmax(1) == target).sum(), "total": torch.tensor(len(target))}


def summarize(sums):
    return {"test_acc": 100.0 * sums["correct"] / sums["total"]}
