#!/usr/bin/python3
"""A small CNN on scikit-learn's 8x8 digits, in the style of pytorch/examples mnist/main.py.

torch_cnn_digits.py is the plain single-process script, with no distributed code at all;
torch_cnn_digits_shardps.py and torch_cnn_digits_ddp.py are it converted, 5 changed lines each
(the diffs are in docs/python.md; scripts/bench-ddp.py times all three):

    python3 examples/torch_cnn_digits.py
    PYTHONPATH=build/python python3 -m shardps.run --servers 2 --workers 4 -- \
        python3 examples/torch_cnn_digits_shardps.py
    python3 -m torch.distributed.run --nproc_per_node 4 examples/torch_cnn_digits_ddp.py

(Debian's torch 1.13 on Python 3.11 cannot parse torch.distributed.run's default --redirects
and --tee; add `--redirects 2 --tee 1`, as scripts/bench-ddp.py does.)

Prints `epoch=E test_accuracy=A elapsed=S` after every epoch (S: seconds since training began)
and `final: test_accuracy=A seconds=S` at the end.
"""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, model, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if args.log_interval and batch_idx % args.log_interval == 0:
            print(f"train epoch={epoch} batch={batch_idx} loss={loss.item():.4f}")


def test(args, model, test_loader, epoch, start):
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            correct += (model(data).argmax(dim=1) == target).sum().item()
    accuracy = correct / len(test_loader.dataset)
    elapsed = time.monotonic() - start
    print(f"epoch={epoch} test_accuracy={accuracy:.4f} elapsed={elapsed:.2f}", flush=True)
    if epoch == args.epochs:
        print(f"final: test_accuracy={accuracy:.4f} seconds={elapsed:.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description="PyTorch digits CNN")
    parser.add_argument("--batch-size", type=int, default=64, help="training batch (default 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train (default 10)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    parser.add_argument("--gamma", type=float, default=0.9, help="StepLR decay per epoch")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--log-interval", type=int, default=0, help="batches between loss lines")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # N,1,8,8
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(np.arange(len(labels)), test_size=0.2,
                                           stratify=digits.target, random_state=0)
    # drop_last: every step sees a full batch.
    train_loader = DataLoader(TensorDataset(images[train_idx], labels[train_idx]),
                              batch_size=args.batch_size, shuffle=True, drop_last=True)
    test_loader = DataLoader(TensorDataset(images[test_idx], labels[test_idx]),
                             batch_size=args.test_batch_size)

    start = time.monotonic()
    for epoch in range(1, args.epochs + 1):
        train(args, model, train_loader, optimizer, epoch)
        scheduler.step()
        test(args, model, test_loader, epoch, start)


if __name__ == "__main__":
    main()
