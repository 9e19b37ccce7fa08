#!/usr/bin/python3
"""A synthetic click-through-rate data set drawn from a hidden ground-truth model (numpy only).

F categorical fields share ONE global id space of `rows` ids: field f owns the ids
[offset_f, offset_f + size_f) (sizes decrease geometrically, ratio 0.6, so the first field is
the largest, as in real CTR logs where a few fields -- user, ad, query -- hold most ids). A
sample draws one id per field:

    rank_f ~ Zipf(a) truncated to 1..size_f          (rank 1 = the most frequent)
    id_f   = offset_f + perm_f[rank_f - 1]             (a fixed random permutation per field, so
                                                        the hot ids are scattered over the range)

and its label from the hidden model (an FM of rank k over the same ids):

    logit = bias + sum_f w[id_f] + sum_{f<g} <v[id_f], v[id_g]>
    label ~ Bernoulli(sigmoid(logit))

w[i] ~ N(0, first_std^2) and v[i] ~ N(0, pair_std^2 I_k) for every id. The defaults (bias -1.5,
first_std 0.42, pair_std 0.275, k 4) give a logit spread of about 1.4 (about 1.2 from the
first-order terms, 0.8 from the 28 pairwise terms) and a click rate near 0.25; the AUC of the
true probabilities on the test split (`best_auc`, printed by `python3 ctr_data.py`) is the best
any model can reach on this data.

The data set is a fixed sequence of samples: sample j lies in block j // BLOCK, and a block is
generated on demand from its own generator (seed, block), so any range of samples costs only
its blocks (vectorised; nothing of size n_train is ever held). Samples [0, n_test) are the test
split (the same whatever n_train is), [n_test, n_test + n_train) the training split. The hidden
parameters and the Zipf tables take about 36 bytes per id (36 MB for 1M ids).

    data = CTRData(rows=1_000_000, seed=1, n_train=8_000_000, n_test=100_000)
    ids, labels, probs = data.train_batch(step, global_batch, rank, world)
    ids, labels, probs = data.test_split()
"""
import argparse
import time

import numpy as np

BLOCK = 16384


def auc(labels, scores):
    """Area under the ROC curve (rank statistic, ties averaged) -- numpy only."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), dtype=np.float64)
    # Average ranks over ties.
    edges = np.flatnonzero(np.diff(s)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(s)]])
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each tie run
    ranks[order] = np.repeat(avg, ends - starts)
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def field_sizes(rows, fields, ratio=0.6):
    """Sizes proportional to ratio**f, at least 2 each, summing to rows exactly."""
    w = ratio ** np.arange(fields, dtype=np.float64)
    sizes = np.maximum(2, np.floor(rows * w / w.sum())).astype(np.int64)
    sizes[0] += rows - sizes.sum()
    if sizes[0] < 2:
        raise ValueError(f"{rows} rows are too few for {fields} fields")
    return sizes


class CTRData:
    def __init__(self, rows=1_000_000, fields=8, seed=1, n_train=4_000_000, n_test=100_000,
                 zipf_a=1.1, rank=4, bias=-1.5, first_std=0.42, pair_std=0.275):
        self.rows, self.fields, self.seed = int(rows), int(fields), int(seed)
        self.n_train, self.n_test = int(n_train), int(n_test)
        self.zipf_a, self.rank = float(zipf_a), int(rank)
        self.bias = float(bias)
        self.sizes = field_sizes(self.rows, self.fields)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        g = np.random.default_rng([self.seed, 0])
        # Hidden model, one entry per global id.
        self.w = (g.standard_normal(self.rows, dtype=np.float32) * first_std).astype(np.float32)
        self.v = (g.standard_normal((self.rows, self.rank), dtype=np.float32)
                  * pair_std).astype(np.float32)
        # Per field: the truncated Zipf CDF over ranks 1..size, and rank -> id permutation.
        self.cdf, self.perm = [], []
        for n in self.sizes:
            p = np.arange(1, n + 1, dtype=np.float64) ** -self.zipf_a
            c = np.cumsum(p)
            c /= c[-1]
            self.cdf.append(c)
            self.perm.append(g.permutation(n).astype(np.int32))
        self._cache = {}

    # ---- generation --------------------------------------------------------------------
    def _block(self, b):
        hit = self._cache.get(b)
        if hit is not None:
            return hit
        g = np.random.default_rng([self.seed, 1, b])
        ids = np.empty((BLOCK, self.fields), dtype=np.int64)
        for f in range(self.fields):
            r = np.searchsorted(self.cdf[f], g.random(BLOCK), side="right")
            r = np.minimum(r, self.sizes[f] - 1)  # u within an ulp of 1
            ids[:, f] = self.offsets[f] + self.perm[f][r]
        logit = self.logit(ids)
        probs = 1.0 / (1.0 + np.exp(-logit))
        labels = (g.random(BLOCK) < probs).astype(np.float32)
        out = (ids, labels, probs.astype(np.float32))
        if len(self._cache) >= 4:
            self._cache.pop(next(iter(self._cache)))
        self._cache[b] = out
        return out

    def logit(self, ids, known=None):
        """The hidden model's logit of samples `ids` (n x F global ids), float64. `known`
        (n x F bool): ids whose hidden values are used; the others count as 0 (their mean)."""
        w = self.w[ids].astype(np.float64)
        v = self.v[ids].astype(np.float64)  # n x F x k
        if known is not None:
            w = w * known
            v = v * known[:, :, None]
        first = w.sum(1)
        s = v.sum(1)
        pair = 0.5 * ((s * s).sum(1) - (v * v).sum((1, 2)))  # sum over f<g of <v_f, v_g>
        return self.bias + first + pair

    def samples(self, start, stop):
        """Samples [start, stop) of the whole sequence: (ids n x F int64, labels float32,
        true probabilities float32)."""
        parts = []
        j = start
        while j < stop:
            b, lo = divmod(j, BLOCK)
            hi = min(BLOCK, lo + (stop - j))
            ids, y, p = self._block(b)
            parts.append((ids[lo:hi], y[lo:hi], p[lo:hi]))
            j += hi - lo
        if not parts:
            return (np.empty((0, self.fields), np.int64), np.empty(0, np.float32),
                    np.empty(0, np.float32))
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))

    # ---- splits ------------------------------------------------------------------------
    def train_range(self, start, count):
        """`count` training samples from position `start` of the (cyclic) training split."""
        start %= self.n_train
        first = min(count, self.n_train - start)
        a = self.samples(self.n_test + start, self.n_test + start + first)
        if first == count:
            return a
        b = self.train_range(0, count - first)
        return tuple(np.concatenate([x, y]) for x, y in zip(a, b))

    def train_batch(self, step, global_batch, rank=0, world=1):
        """Rank `rank`'s contiguous 1/world of global batch `step` (global_batch % world == 0).
        The concatenation over ranks 0..world-1 is the global batch."""
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not a multiple of {world} workers")
        local = global_batch // world
        return self.train_range(step * global_batch + rank * local, local)

    def test_split(self):
        return self.samples(0, self.n_test)

    def id_counts(self, n, chunk=1 << 20):
        """How often each id occurs in the first n training samples."""
        counts = np.zeros(self.rows, dtype=np.int64)
        for lo in range(0, n, chunk):
            ids, _, _ = self.train_range(lo, min(chunk, n - lo))
            counts += np.bincount(ids.ravel(), minlength=self.rows)
        return counts

    def describe(self):
        return (f"{self.rows} ids in {self.fields} fields (sizes {self.sizes.tolist()}), "
                f"Zipf a={self.zipf_a}, hidden FM rank {self.rank}, "
                f"{self.n_train} train / {self.n_test} test samples")


def main():
    ap = argparse.ArgumentParser(description="Generate the synthetic CTR data set and report "
                                 "its statistics and best achievable AUC.")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--fields", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=6_144_000,
                    help="training samples (default: run_ctr.sh's full run, 1500 x 4096)")
    ap.add_argument("--n-test", type=int, default=100_000)
    ap.add_argument("--oracle", action="store_true",
                    help="also report the AUC of an oracle knowing the hidden values of the "
                    "ids seen >= 1, 5, 20 times in the training split")
    a = ap.parse_args()
    t0 = time.time()
    d = CTRData(rows=a.rows, fields=a.fields, seed=a.seed, n_train=a.n_train, n_test=a.n_test)
    t1 = time.time()
    ids, y, p = d.test_split()
    t2 = time.time()
    print(d.describe())
    print(f"setup {t1 - t0:.2f} s; test split {t2 - t1:.2f} s "
          f"({a.n_test / max(t2 - t1, 1e-9):,.0f} samples/s)")
    print(f"test: click rate {y.mean():.4f}, best achievable AUC {auc(y, p):.4f}")
    n = a.n_train
    counts = d.id_counts(n)
    print(f"{n} training samples: distinct ids {np.count_nonzero(counts)} of {a.rows}")
    for f in range(a.fields):
        c = counts[d.offsets[f]:d.offsets[f] + d.sizes[f]]
        print(f"  field {f}: {d.sizes[f]:>7} ids, {np.count_nonzero(c):>7} seen, top id "
              f"{c.max() / n:.3f} of samples, ids seen < 5 times cover {c[c < 5].sum() / n:.3f}")
    if a.oracle:
        ids, y, _ = d.test_split()
        for k in (1, 5, 20):
            known = counts[ids] >= k
            print(f"oracle knowing the ids seen >= {k:>2} times in the {a.n_train:,} training "
                  f"samples ({known.mean():.3f} of the test ids): AUC "
                  f"{auc(y, d.logit(ids, known)):.4f}")


if __name__ == "__main__":
    main()
