#!/usr/bin/python3
"""Click-through-rate training on the synthetic data of ctr_data.py, with the embedding rows on
the ShardPS parameter servers -- or, as the reference, in one process.

    # the reference: one process, the whole global batch per step
    PYTHONPATH=build/python /usr/bin/python3 examples/ctr/ctr_train.py --mode local

    # the cluster: 2 servers hold the 1M x 64 table, 4 workers each take a quarter of every
    # global batch (BSP: the servers average the 4 gradients, so a step is the same step)
    PYTHONPATH=build/python /usr/bin/python3 -m shardps.run --servers 2 --workers 4 \
        --consistency bsp --transport tcp -- \
        /usr/bin/python3 examples/ctr/ctr_train.py --mode shardps

Both modes start from the same table (shardps.row_init), the same MLP (seeded), apply the same
optimizers (Adagrad on the table's rows, Adam on the MLP) to the same global batches in the same
order, so their test AUCs agree up to float rounding (run_ctr.sh checks |difference| < 0.005).
In shardps mode rank 0 evaluates (its forward pulls the rows it needs) and writes --out.
"""
import argparse
import json
import os
import resource
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctr_data  # noqa: E402
import ctr_model  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["local", "shardps"], required=True)
    ap.add_argument("--rows", type=int, default=1_000_000,
                    help="ids in the global id space = embedding rows (default 1,000,000)")
    ap.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    ap.add_argument("--fields", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--global-batch", type=int, default=4096,
                    help="samples per step over all workers (a multiple of the workers)")
    ap.add_argument("--seed", type=int, default=1, help="data set and model seed")
    ap.add_argument("--n-train", type=int, default=0,
                    help="training split, read cyclically (default 0: steps x global batch, "
                    "one pass: every training sample is seen once, as in online CTR training; "
                    "a second pass lets the rows memorise samples)")
    ap.add_argument("--n-test", type=int, default=100_000, help="test split")
    ap.add_argument("--emb-lr", type=float, default=0.03, help="Adagrad lr of the rows")
    ap.add_argument("--emb-acc", type=float, default=0.0,
                    help="Adagrad initial_accumulator_value of the rows")
    ap.add_argument("--mlp-lr", type=float, default=1e-3, help="Adam lr of the MLP")
    ap.add_argument("--init-scale", type=float, default=0.01,
                    help="rows start N(0, init_scale^2)")
    ap.add_argument("--hidden", default="128,64", help="MLP hidden widths")
    ap.add_argument("--interaction", choices=["fm", "none"], default="fm",
                    help="fm: add DeepFM's pairwise term sum_{f<g} <e_f, e_g> to the MLP's "
                    "logit; none: the MLP alone")
    ap.add_argument("--dense-impl", choices=["conv", "linear"], default="conv",
                    help="the MLP's layers as 1x1 convolutions (oneDNN; default) or nn.Linear "
                    "(BLAS: Debian's torch uses the slow reference BLAS)")
    ap.add_argument("--eval-every", type=int, default=250, help="evaluate every N steps (0: "
                    "only at the end)")
    ap.add_argument("--eval-batch", type=int, default=16384)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: the cores / the workers on this host)")
    ap.add_argument("--out", default=None, help="write the results (JSON) here (rank 0)")
    return ap.parse_args(argv)


def evaluate(model, test, eval_batch):
    ids, labels, _ = test
    scores = np.empty(len(labels), dtype=np.float32)
    with torch.no_grad():
        for lo in range(0, len(labels), eval_batch):
            hi = min(len(labels), lo + eval_batch)
            scores[lo:hi] = model(torch.from_numpy(ids[lo:hi])).numpy()
    try:
        from sklearn.metrics import roc_auc_score
        auc = float(roc_auc_score(labels, scores))
    except ImportError:
        auc = ctr_data.auc(labels, scores)
    t = torch.from_numpy(scores)
    logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(
        t, torch.from_numpy(labels)))
    return auc, logloss


def main(argv=None):
    a = parse_args(argv)
    t_start = time.time()
    world = int(os.environ.get("SHARDPS_NUM_WORKERS", "1")) if a.mode == "shardps" else 1
    if a.global_batch % world:
        sys.exit(f"--global-batch {a.global_batch} is not a multiple of {world} workers")
    local_batch = a.global_batch // world
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)

    a.n_train = a.n_train or a.steps * a.global_batch
    data = ctr_data.CTRData(rows=a.rows, fields=a.fields, seed=a.seed, n_train=a.n_train,
                            n_test=a.n_test)
    hidden = tuple(int(h) for h in a.hidden.split(",") if h)

    if a.mode == "local":
        table = ctr_model.local_table(a.rows, a.dim, a.init_scale, a.seed)
        model = ctr_model.CTRModel(table, a.fields, a.dim, hidden, seed=a.seed,
                                   impl=a.dense_impl, interaction=a.interaction)
        opt_rows = torch.optim.Adagrad(model.table.parameters(), lr=a.emb_lr,
                                       initial_accumulator_value=a.emb_acc)
        opt_mlp = torch.optim.Adam(model.mlp.parameters(), lr=a.mlp_lr)
        optimizers = [opt_rows, opt_mlp]
        rank = 0

        def step_fn():
            for o in optimizers:
                o.step()

        def zero_fn():
            for o in optimizers:
                o.zero_grad()
    else:
        import shardps.torch as spt
        # A shard gets at most the distinct ids of this worker's part of a step.
        max_ids = min(local_batch * a.fields, a.rows)
        table = ctr_model.shardps_table(a.rows, a.dim, a.init_scale, a.seed, a.emb_lr,
                                       a.emb_acc, max_ids)
        model = ctr_model.CTRModel(table, a.fields, a.dim, hidden, seed=a.seed,
                                   impl=a.dense_impl, interaction=a.interaction)
        # The wrapped Adam is applied by the servers to the MLP; the table (found in the model)
        # is registered and its Adagrad rule sent by DistributedOptimizer.
        opt = spt.DistributedOptimizer(torch.optim.Adam(model.mlp.parameters(), lr=a.mlp_lr),
                                       model, consistency="bsp")
        rank = opt.rank
        if opt.num_workers != world:
            sys.exit(f"SHARDPS_NUM_WORKERS={world} but the cluster has {opt.num_workers}")
        step_fn, zero_fn = opt.step, opt.zero_grad

    log = (lambda *x: print(*x, flush=True)) if rank == 0 else (lambda *x: None)
    log(f"ctr: mode {a.mode}, {world} worker(s), rank {rank}; {data.describe()}")
    log(f"ctr: table {a.rows} x {a.dim} ({a.rows * a.dim * 4 / 2**20:.0f} MiB float32), "
        f"MLP {a.fields * a.dim}->{'->'.join(map(str, hidden))}->1; global batch "
        f"{a.global_batch} ({local_batch} per worker), {a.steps} steps, {threads} thread(s)")

    test = best_auc = None
    if rank == 0:
        test = data.test_split()
        best_auc = ctr_data.auc(test[1], test[2])
        log(f"ctr: test split {a.n_test} samples, click rate {test[1].mean():.4f}, best "
            f"achievable AUC (true probabilities) {best_auc:.4f}")

    history, loss_sum, loss_n = [], 0.0, 0
    train_s = eval_s = 0.0
    t_train0 = time.time()
    t_mark, steps_mark = time.time(), 0
    loss_fn = torch.nn.BCEWithLogitsLoss()
    phases = dict.fromkeys(("data", "forward", "backward", "step"), 0.0)  # rank 0's seconds
    counters0 = opt.client.counters() if a.mode == "shardps" else None
    for step in range(a.steps):
        t0 = time.time()
        ids, labels, _ = data.train_batch(step, a.global_batch, rank, world)
        t1 = time.time()
        zero_fn()
        loss = loss_fn(model(torch.from_numpy(ids)), torch.from_numpy(labels))  # pulls rows
        t2 = time.time()
        loss.backward()
        t3 = time.time()
        step_fn()  # shardps: pushes the MLP's and the rows' gradients, BSP clock, pulls the MLP
        t4 = time.time()
        for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k] += dt
        train_s += t4 - t0
        loss_sum += float(loss)
        loss_n += 1
        done = step + 1
        if a.log_every and done % a.log_every == 0:
            now = time.time()
            rate = (done - steps_mark) * a.global_batch / max(now - t_mark, 1e-9)
            log(f"step {done:>6}/{a.steps}  train loss {loss_sum / loss_n:.4f}"
                f"{' (rank 0 quarter)' if world > 1 else ''}  {rate:,.0f} samples/s")
            loss_sum, loss_n = 0.0, 0
            t_mark, steps_mark = now, done
        if rank == 0 and (done == a.steps or (a.eval_every and done % a.eval_every == 0)):
            t0 = time.time()
            auc, ll = evaluate(model, test, a.eval_batch)
            eval_s += time.time() - t0
            history.append({"step": done, "test_auc": auc, "test_logloss": ll,
                            "seconds": round(time.time() - t_train0, 2)})
            log(f"eval step {done:>6}: test AUC {auc:.4f} (best achievable {best_auc:.4f}), "
                f"logloss {ll:.4f}, eval {time.time() - t0:.1f} s")
            t_mark = time.time()  # the eval's time is not training time
    t_end = time.time()
    comm = None
    if a.mode == "shardps":
        # Rank 0's data path over the run (its evaluations' row reads included).
        c1 = opt.client.counters()
        comm = {k: c1[k] - counters0[k] for k in ("rows_pulled", "row_reads", "row_retries",
                                                 "rows_pushed", "bytes_pushed", "bytes_pulled",
                                                 "pushes", "pulls", "pull_retries")}

    if rank == 0:
        final = history[-1]
        result = {
            "mode": a.mode, "workers": world, "rows": a.rows, "dim": a.dim, "fields": a.fields,
            "steps": a.steps, "global_batch": a.global_batch, "seed": a.seed,
            "n_train": a.n_train, "n_test": a.n_test, "emb_lr": a.emb_lr, "emb_acc": a.emb_acc,
            "mlp_lr": a.mlp_lr,
            "init_scale": a.init_scale, "interaction": a.interaction,
            "final_test_auc": final["test_auc"], "final_test_logloss": final["test_logloss"],
            "best_auc": best_auc, "history": history,
            "train_seconds": round(train_s, 2), "eval_seconds": round(eval_s, 2),
            "wall_seconds": round(t_end - t_start, 2),
            "samples_per_s": round(a.steps * a.global_batch / max(train_s, 1e-9), 1),
            "rank0_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                        / 1024, 1),
            "threads": threads,
            "rank0_phase_seconds": {k: round(v, 2) for k, v in phases.items()},
            "rank0_counters": comm,
        }
        log(f"final: mode {a.mode} test AUC {final['test_auc']:.4f} best achievable "
            f"{best_auc:.4f} steps {a.steps} train {train_s:.1f} s "
            f"({result['samples_per_s']:,.0f} samples/s) wall {t_end - t_start:.1f} s")
        log("final: rank 0's training seconds: " + ", ".join(
            f"{k} {v:.1f}" for k, v in phases.items()) + ("" if comm is None else
            f"; rows pulled {comm['rows_pulled']:,} (incl. evaluation), rows pushed "
            f"{comm['rows_pushed']:,}"))
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(a.out + ".tmp", a.out)
    if a.mode == "shardps":
        opt.close()


if __name__ == "__main__":
    main()
