"""The CTR model: one embedding table over the global id space, per-field lookups, concat, MLP,
plus DeepFM's pairwise term on the same embeddings.

    ids (B x F, global ids) -> table -> e: B x F x dim
    logit = MLP(concat(e): B x (F*dim) -> 128 -> 64 -> 1) + sum_{f<g} <e_f, e_g>

The table class is injected, so the same model runs in one process (torch.nn.Embedding with
sparse gradients, optimised by torch.optim.Adagrad) and on a ShardPS cluster
(shardps.torch.Embedding: rows on the servers, Adagrad applied there with torch's sparse
semantics). Both start from identical values: the rows from shardps.row_init (the servers'
own initialiser), the MLP from torch.manual_seed(seed).
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

TABLE_NAME = "ctr.emb"


class Dense(nn.Linear):
    """nn.Linear (same parameters, same initial values, same function), computed as a 1x1
    convolution. Debian's torch 1.13 links the reference (netlib) BLAS, so nn.Linear's matrix
    products run at about 2-3 GFLOP/s per core; convolutions go through oneDNN (mkldnn), about
    6x faster forward and backward here. impl="linear" uses plain nn.Linear."""

    def __init__(self, in_features, out_features, impl="conv"):
        super().__init__(in_features, out_features)
        self.impl = impl

    def forward(self, x):
        if self.impl == "linear":
            return super().forward(x)
        n = x.shape[0]
        y = F.conv2d(x.reshape(n, self.in_features, 1, 1),
                     self.weight.view(self.out_features, self.in_features, 1, 1), self.bias)
        return y.reshape(n, self.out_features)


class CTRModel(nn.Module):
    def __init__(self, table, fields, dim, hidden=(128, 64), seed=0, impl="conv",
                 interaction="fm"):
        super().__init__()
        self.interaction = interaction
        self.table = table  # any module mapping ids (B x F) -> B x F x dim
        self.fields, self.dim = fields, dim
        torch.manual_seed(seed)  # the dense part's initial values, equal in both modes
        layers, width = [], fields * dim
        for h in hidden:
            layers += [Dense(width, h, impl), nn.ReLU()]
            width = h
        layers.append(Dense(width, 1, impl))
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids):
        e = self.table(ids)  # B x F x dim
        logit = self.mlp(e.reshape(ids.shape[0], self.fields * self.dim)).squeeze(-1)
        if self.interaction == "fm":
            # DeepFM's second-order term on the same embeddings: sum over field pairs f < g of
            # <e_f, e_g> = (|sum_f e_f|^2 - sum_f |e_f|^2) / 2.
            s = e.sum(1)
            logit = logit + 0.5 * ((s * s).sum(1) - (e * e).sum((1, 2)))
        return logit


def local_table(rows, dim, init_scale, init_seed, block=1 << 16):
    """torch.nn.Embedding(rows, dim, sparse=True) holding exactly the rows the servers start
    from (shardps.row_init, filled in blocks to bound the temporary memory)."""
    import shardps
    w = torch.empty(rows, dim, dtype=torch.float32)
    for lo in range(0, rows, block):
        hi = min(rows, lo + block)
        w[lo:hi] = torch.from_numpy(
            shardps.row_init("normal", init_scale, init_seed, np.arange(lo, hi, dtype=np.int64),
                             dim))
    return nn.Embedding(rows, dim, sparse=True, _weight=w)


def shardps_table(rows, dim, init_scale, init_seed, lr, initial_accumulator_value, max_ids):
    """The same table on the parameter servers, with the servers applying Adagrad (torch's
    sparse Adagrad: lr, eps 1e-10, no lr decay, this initial accumulator)."""
    import shardps.torch as spt
    return spt.Embedding(rows, dim, name=TABLE_NAME, init="normal", init_scale=init_scale,
                         init_seed=init_seed, optimizer="adagrad", lr=lr,
                         initial_accumulator_value=initial_accumulator_value, max_ids=max_ids)
