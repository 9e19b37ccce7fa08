#!/usr/bin/python3
"""torch_digits: a PyTorch MLP on scikit-learn's digits, trained through ShardPS.

Each worker computes gradients on its shard of every global minibatch; the DistributedOptimizer
pushes them into the servers' memory, the servers apply --optimizer/--lr, and the new weights
are pulled straight into the model's parameters. --standalone trains the same model in one
process with the same hyper-parameters and the same global batches (torch.optim.SGD with the
servers' momentum rule), the baseline the distributed run is compared with.

Launch (the launchers pass --coordinator, --transport, --bind_ip and --data first):
  scripts/mpirun.sh --servers 2 --workers 4 --trainer examples/torch_digits.py \\
      --mpi-arg -x --mpi-arg PYTHONPATH -- --epochs 15
  scripts/launch-local.sh --trainer examples/torch_digits.py -- --epochs 3
  examples/torch_digits.py --standalone --workers 4 --epochs 15

Data sharding as examples/digits_trainer.cc: the same seeded permutation per epoch on every
worker; global step t takes positions [t*W*B, (t+1)*W*B), worker r every W-th from r.
Rank 0 prints "final: test accuracy ..." (the launchers look for it).
"""
import argparse
import os
import struct
import sys
import time

import numpy as np
import torch

MAGIC = b"SPDG"


def load_bin(path):
    with open(path, "rb") as f:
        head = f.read(20)
        if head[:4] != MAGIC:
            raise ValueError(f"{path}: not a digits data file")
        _, n, feats, classes = struct.unpack("<IIII", head[4:])
        x = np.frombuffer(f.read(4 * n * feats), dtype="<f4").reshape(n, feats)
        y = np.frombuffer(f.read(n), dtype=np.uint8)
    return torch.from_numpy(x.copy()), torch.from_numpy(y.astype(np.int64)), classes


def load_data(train_path):
    """The files of scripts/export_digits.py if present, else the same split from sklearn."""
    test_path = train_path.replace("train", "test") if train_path else ""
    if train_path and os.path.exists(train_path) and os.path.exists(test_path):
        xtr, ytr, classes = load_bin(train_path)
        xte, yte, _ = load_bin(test_path)
        return xtr, ytr, xte, yte, classes
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.2, random_state=20240611,
                                          stratify=d.target)
    t = torch.from_numpy
    return t(xtr), t(ytr.astype(np.int64)), t(xte), t(yte.astype(np.int64)), 10


def make_model(features, hidden, classes, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))


@torch.no_grad()
def accuracy(model, x, y):
    return (model(x).argmax(1) == y).float().mean().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", default="127.0.0.1:7070")
    p.add_argument("--cluster_token", default=os.environ.get("SHARDPS_CLUSTER_TOKEN", ""))
    p.add_argument("--transport", default="auto")
    p.add_argument("--bind_ip", default="")
    p.add_argument("--data", default="build/data/digits_train.bin")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch_size", type=int, default=32, help="per worker per step")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--consistency", default=None,
                   help="bsp, ssp, asp or vsgd: required of the cluster (checked)")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--min_accuracy", type=float, default=0.0, help="exit 3 below this")
    p.add_argument("--standalone", action="store_true", help="one process, no cluster")
    p.add_argument("--workers", type=int, default=1, help="--standalone: W of the global batch")
    p.add_argument("--lr", type=float, default=0.2, help="--standalone (cluster: servers' --lr)")
    p.add_argument("--momentum", type=float, default=0.9, help="--standalone, momentum rule")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    a = p.parse_args()
    torch.set_num_threads(1)  # several workers share this host's cores

    xtr, ytr, xte, yte, classes = load_data(a.data)
    model = make_model(xtr.shape[1], a.hidden, classes, a.seed).to(a.device)
    xtr, ytr, xte, yte = (t.to(a.device) for t in (xtr, ytr, xte, yte))
    if a.standalone:
        opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
        rank, W, what = 0, a.workers, f"standalone sgd lr {a.lr} momentum {a.momentum}"
    else:
        import shardps.torch
        opt = shardps.torch.DistributedOptimizer(
            model, coordinator=a.coordinator, cluster_token=a.cluster_token,
            transport=a.transport, bind_ip=a.bind_ip, consistency=a.consistency,
            staleness=a.staleness)
        rank, W = opt.rank, opt.num_workers
        what = f"transport {opt.client.transport}, consistency {opt.client.consistency}"
    B = a.batch_size
    n = xtr.shape[0]
    steps_per_epoch = n // (W * B)
    tag = f"[worker {rank}/{W}]"
    print(f"{tag} torch mlp {xtr.shape[1]}-{a.hidden}-{classes}, batch {B} per worker "
          f"(global {W * B}), {steps_per_epoch} steps/epoch, {what}", flush=True)
    t0 = time.monotonic()
    step = 0
    for epoch in range(a.epochs):
        perm = torch.from_numpy(np.random.RandomState(a.seed * 1000 + epoch).permutation(n))
        losses = []
        for s in range(steps_per_epoch):
            glob = perm[s * W * B:(s + 1) * W * B]
            idx = glob if a.standalone else glob[rank::W]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
        if rank == 0:
            print(f"{tag} epoch {epoch + 1}/{a.epochs} loss {np.mean(losses):.4f} "
                  f"test accuracy {accuracy(model, xte, yte):.4f}", flush=True)
    elapsed = time.monotonic() - t0
    acc = accuracy(model, xte, yte)
    print(f"{tag} test accuracy {acc:.4f} ({len(yte)} samples), train accuracy "
          f"{accuracy(model, xtr, ytr):.4f}", flush=True)
    if rank == 0:
        print(f"final: test accuracy {acc:.4f} after {step} steps, "
              f"{step * W * B / elapsed:.0f} samples/s, {what}, {W} workers", flush=True)
    if not a.standalone:
        opt.close()
    if acc < a.min_accuracy:
        print(f"{tag} test accuracy {acc:.4f} is below --min_accuracy {a.min_accuracy}",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
