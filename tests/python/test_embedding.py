"""shardps.torch.Embedding / EmbeddingBag (row tables on the servers) against plain torch with
sparse embeddings, on real local clusters (tcp). One worker, BSP: the servers' sparse rules
(SGD, Adagrad, lazy Adam = torch.optim.SparseAdam) must give torch's losses and rows."""
import unittest

import numpy as np

import shardps
import shardps.launch

try:
    import torch
    import shardps.torch as spt
except ImportError:  # pragma: no cover
    torch = None


def cluster():
    return shardps.launch.LocalCluster(servers=2, workers=1, consistency="bsp", transport="tcp",
                                       grace=1.0)


@unittest.skipIf(torch is None, "torch is not installed")
class EmbeddingTest(unittest.TestCase):
    ROWS, BAG_ROWS, DIM = 1000, 500, 8

    def batches(self, steps):
        g = torch.Generator().manual_seed(5)
        for _ in range(steps):
            a = torch.randint(0, self.ROWS, (16, 3), generator=g)
            a[:, 0] = a[0, 0]  # a duplicated row in every batch
            yield a, torch.randint(0, self.BAG_ROWS, (16, 4), generator=g)

    def run_pair(self, emb_rule, emb_kw, torch_opt, overlap=False):
        steps = 25
        torch.manual_seed(1)
        fc0 = torch.nn.Linear(2 * self.DIM, 1).state_dict()
        target = torch.linspace(-1, 1, 16).unsqueeze(1)

        class M(torch.nn.Module):
            def __init__(s):
                super().__init__()
                s.emb = spt.Embedding(self.ROWS, self.DIM, optimizer=emb_rule, init="uniform",
                                      init_scale=0.1, init_seed=3, **emb_kw)
                s.bag = spt.EmbeddingBag(self.BAG_ROWS, self.DIM, mode="mean",
                                         optimizer="sgd", lr=0.2)
                s.fc = torch.nn.Linear(2 * self.DIM, 1)
                s.fc.load_state_dict(fc0)

            def forward(s, a, b):
                return s.fc(torch.cat([s.emb(a).sum(1), s.bag(b)], 1))

        ours = []
        with cluster() as cl:
            m = M()
            opt = spt.DistributedOptimizer(torch.optim.SGD(m.fc.parameters(), lr=0.05), m,
                                           coordinator=cl.address, cluster_token=cl.token,
                                           rank=0, transport="tcp", overlap=overlap)
            for a, b in self.batches(steps):
                opt.zero_grad()
                loss = ((m(a, b) - target) ** 2).mean()
                loss.backward()
                opt.step()
                ours.append(float(loss))
            with torch.no_grad():
                rows = m.emb(torch.arange(self.ROWS)).clone()
            counters = opt.client.counters()
            opt.close()

        class R(torch.nn.Module):
            def __init__(s):
                super().__init__()
                s.emb = torch.nn.Embedding(self.ROWS, self.DIM, sparse=True)
                s.bag = torch.nn.EmbeddingBag(self.BAG_ROWS, self.DIM, mode="mean", sparse=True)
                s.fc = torch.nn.Linear(2 * self.DIM, 1)
                s.fc.load_state_dict(fc0)
                with torch.no_grad():
                    s.emb.weight.copy_(torch.from_numpy(shardps.row_init(
                        "uniform", 0.1, 3, np.arange(self.ROWS, dtype=np.int64), self.DIM)))
                    s.bag.weight.copy_(torch.from_numpy(shardps.row_init(
                        "normal", 1.0, 0, np.arange(self.BAG_ROWS, dtype=np.int64), self.DIM)))

            def forward(s, a, b):
                return s.fc(torch.cat([s.emb(a).sum(1), s.bag(b)], 1))

        r = R()
        opts = [torch_opt(r.emb.parameters()),
                torch.optim.SGD(r.bag.parameters(), lr=0.2),
                torch.optim.SGD(r.fc.parameters(), lr=0.05)]
        theirs = []
        for a, b in self.batches(steps):
            for o in opts:
                o.zero_grad()
            loss = ((r(a, b) - target) ** 2).mean()
            loss.backward()
            for o in opts:
                o.step()
            theirs.append(float(loss))
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
        # The rows themselves (float32 on both sides; only summation order differs).
        np.testing.assert_allclose(rows.numpy(), r.emb.weight.detach().numpy(), atol=2e-5)
        self.assertGreater(ours[0], ours[-1])  # it trained
        # Each step read only the batch's distinct rows (at most 48 + 64), never the table.
        self.assertLessEqual(counters["rows_pulled"], steps * (48 + 64) + self.ROWS)
        return ours

    def test_row_gradients_are_unscaled_and_checked_like_dense_ones(self):
        """GradScaler scales the loss, so a table's gradient rows (added in backward, not in
        param_groups) come scaled too: step(grad_scaler=...) divides them by the scale, and an
        inf among them skips the step as a dense one does (check_finite likewise). Before, the
        rows were pushed S times too large and an overflow in them alone was never seen."""
        try:  # torch >= 2.3
            from torch.amp.grad_scaler import OptState
        except ImportError:  # torch 1.13 (Debian 12)
            from torch.cuda.amp.grad_scaler import OptState
        ids = torch.tensor([[3, 7], [7, 9]])

        def run(scale, inf_rows, check_finite=False):
            torch.manual_seed(0)  # the same fc in every run
            with cluster() as cl:
                emb = spt.Embedding(self.ROWS, self.DIM, optimizer="sgd", lr=0.5, init="uniform",
                                    init_scale=0.1, init_seed=3)
                fc = torch.nn.Linear(self.DIM, 1)
                m = torch.nn.ModuleDict({"emb": emb, "fc": fc})
                opt = spt.DistributedOptimizer(torch.optim.SGD(fc.parameters(), lr=0.1), m,
                                               coordinator=cl.address, cluster_token=cl.token,
                                               rank=0, transport="tcp",
                                               check_finite=check_finite)
                before = emb(torch.arange(10)).detach().clone()
                opt.zero_grad()
                loss = fc(emb(ids).sum(1)).sum() * scale
                if inf_rows:
                    loss = loss + (emb(torch.tensor([[9]])) * float("inf")).sum()
                loss.backward()
                if scale != 1.0 or inf_rows and not check_finite:
                    # A scaler whose unscale_ the trainer already called (to clip): the dense
                    # gradients are divided; the rows are left for step() to divide.
                    for p in fc.parameters():
                        p.grad.div_(scale)
                    dev = fc.weight.device
                    state = {"stage": OptState.UNSCALED,
                             "found_inf_per_device": {dev: torch.zeros(1)}}

                    class Scaler:
                        _scale = torch.tensor(float(scale))
                        _per_optimizer_states = {id(opt): state}
                    opt.step(grad_scaler=Scaler())
                else:
                    opt.step()
                after = emb(torch.arange(10)).detach().clone()
                skipped = opt.skipped
                opt.close()
                return before, after, skipped

        b1, a1, s1 = run(1.0, False)
        b2, a2, s2 = run(1024.0, False)
        self.assertFalse(s1 or s2)
        self.assertFalse(torch.equal(a1, b1))  # it stepped
        torch.testing.assert_close(a2, a1, rtol=0, atol=0)  # 1024 is exact: the same step
        for check_finite in (False, True):
            b3, a3, s3 = run(1024.0 if not check_finite else 1.0, True, check_finite)
            self.assertTrue(s3, "an inf among the rows skips the step")
            torch.testing.assert_close(a3, b3, rtol=0, atol=0)  # nothing applied

    def test_clipping_covers_the_rows_and_zero_grad_drops_an_abandoned_batch(self):
        """opt.clip_grad_norm_ clips by the norm of the whole gradient, the rows' included
        (torch's clip_grad_norm_ never sees them: they live in the client), and zero_grad()
        drops the rows of a batch the trainer abandoned. The reference: torch's dense
        nn.Embedding, plain SGD (the same update as sparse SGD), torch's clip_grad_norm_ over
        every parameter, the abandoned batches never run. Under a loss scale (a GradScaler
        stand-in whose unscale_ the trainer called) the rows are unscaled once, by the clip,
        not again by step()."""
        try:  # torch >= 2.3
            from torch.amp.grad_scaler import OptState
        except ImportError:  # torch 1.13 (Debian 12)
            from torch.cuda.amp.grad_scaler import OptState
        steps, max_norm, lr = 12, 0.5, 0.5
        torch.manual_seed(2)
        fc0 = torch.nn.Linear(self.DIM, 1).state_dict()
        target = torch.linspace(-1, 1, 16).unsqueeze(1)
        g = torch.Generator().manual_seed(9)
        batches = [torch.randint(0, self.ROWS, (16, 3), generator=g) for _ in range(steps)]
        init = torch.from_numpy(shardps.row_init("uniform", 0.5, 3,
                                                 np.arange(self.ROWS, dtype=np.int64), self.DIM))

        def ours(scale):
            with cluster() as cl:
                emb = spt.Embedding(self.ROWS, self.DIM, optimizer="sgd", lr=lr, init="uniform",
                                    init_scale=0.5, init_seed=3)
                fc = torch.nn.Linear(self.DIM, 1)
                fc.load_state_dict(fc0)
                m = torch.nn.ModuleDict({"emb": emb, "fc": fc})
                opt = spt.DistributedOptimizer(torch.optim.SGD(fc.parameters(), lr=lr), m,
                                               coordinator=cl.address, cluster_token=cl.token,
                                               rank=0, transport="tcp")
                norms = []
                for i, a in enumerate(batches):
                    opt.zero_grad()
                    loss = ((fc(emb(a).sum(1)) - target) ** 2).mean() * scale
                    loss.backward()
                    if i % 3 == 2:
                        continue  # abandoned: its rows must not reach the next step
                    if scale == 1.0:
                        norms.append(float(opt.clip_grad_norm_(max_norm)))
                        opt.step()
                        continue
                    for p in fc.parameters():  # what scaler.unscale_(opt) did to them
                        p.grad.div_(scale)
                    state = {"stage": OptState.UNSCALED,
                             "found_inf_per_device": {fc.weight.device: torch.zeros(1)}}

                    class Scaler:
                        _scale = torch.tensor(float(scale))
                        _per_optimizer_states = {id(opt): state}

                        def is_enabled(self):
                            return True
                    norms.append(float(opt.clip_grad_norm_(max_norm, grad_scaler=Scaler())))
                    opt.step(grad_scaler=Scaler())
                with torch.no_grad():
                    rows = emb(torch.arange(self.ROWS)).clone()
                w = fc.weight.detach().clone()
                opt.close()
            return norms, rows, w

        ref_emb = torch.nn.Embedding(self.ROWS, self.DIM)
        with torch.no_grad():
            ref_emb.weight.copy_(init)
        ref_fc = torch.nn.Linear(self.DIM, 1)
        ref_fc.load_state_dict(fc0)
        params = list(ref_emb.parameters()) + list(ref_fc.parameters())
        ref_opt = torch.optim.SGD(params, lr=lr)
        ref_norms = []
        for i, a in enumerate(batches):
            if i % 3 == 2:
                continue
            ref_opt.zero_grad()
            ((ref_fc(ref_emb(a).sum(1)) - target) ** 2).mean().backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
            ref_opt.step()
        self.assertTrue(any(n > max_norm for n in ref_norms), "the clip must bite")
        for scale in (1.0, 1024.0):
            norms, rows, w = ours(scale)
            np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
            np.testing.assert_allclose(rows.numpy(), ref_emb.weight.detach().numpy(), atol=1e-5)
            np.testing.assert_allclose(w.numpy(), ref_fc.weight.detach().numpy(), atol=1e-5)

    def test_sgd_rows_match_torch_sparse(self):
        self.run_pair("sgd", {"lr": 0.3}, lambda p: torch.optim.SGD(p, lr=0.3))

    def test_adagrad_rows_match_torch_sparse(self):
        self.run_pair("adagrad", {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1},
                      lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01,
                                                    initial_accumulator_value=0.1))

    def test_lazy_adam_rows_match_torch_sparse_adam(self):
        self.run_pair("adam", {"lr": 0.02, "betas": (0.8, 0.99)},
                      lambda p: torch.optim.SparseAdam(list(p), lr=0.02, betas=(0.8, 0.99)))

    def test_overlap_pushes_the_tables_at_step(self):
        """overlap=True: the dense layer's bucket is pushed during backward, the tables'
        sparse gradients at step(), before the clock. Same losses and rows as torch (run_pair
        checks them), and bit for bit the losses of the same run without overlap."""
        rule = ("adagrad", {"lr": 0.1}, lambda p: torch.optim.Adagrad(p, lr=0.1))
        plain = self.run_pair(*rule)
        overlapped = self.run_pair(*rule, overlap=True)
        self.assertEqual(plain, overlapped)

    def test_bad_ids_and_rules_are_clear_errors(self):
        with cluster() as cl:
            m = torch.nn.ModuleDict({"emb": spt.Embedding(10, 4, optimizer="sgd", lr=0.1),
                                     "fc": torch.nn.Linear(4, 1)})
            opt = spt.DistributedOptimizer(torch.optim.SGD(m["fc"].parameters(), lr=0.1), m,
                                           coordinator=cl.address, cluster_token=cl.token,
                                           rank=0, transport="tcp")
            with self.assertRaises(shardps.Error) as e:
                m["emb"](torch.tensor([1, 10]))
            self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
            self.assertIn("'emb'", e.exception.message)
            with self.assertRaises(shardps.Error):
                opt.client.set_rule("emb", "sgd", 0.1, momentum=0.9)
            with self.assertRaises(TypeError):
                opt.client.pull_rows("emb", np.array([1.0]), np.zeros(4, np.float32))
            with self.assertRaises(ValueError):
                opt.client.pull_rows("emb", np.array([1], np.int64), np.zeros(3, np.float32))
            self.assertEqual(m["emb"](torch.tensor([3])).shape, (1, 4))  # still working
            opt.close()
        with self.assertRaises(ValueError):
            spt.Embedding(10, 4, optimizer="adamw")

    def test_a_torch_sparse_embedding_is_named_as_trained_dense(self):
        """nn.Embedding(sparse=True) trains (as a dense tensor, exactly as torch's SGD would
        with a dense gradient), and the optimizer says once that its whole table moves every
        step, naming the module and the row table to use instead."""
        with cluster() as cl:
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Embedding(50, 4, sparse=True), torch.nn.Linear(4, 1))
            ref = torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Linear(4, 1))
            ref.load_state_dict(m.state_dict())
            with self.assertLogs("shardps", level="WARNING") as logs:
                opt = spt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                                               coordinator=cl.address, cluster_token=cl.token,
                                               rank=0, transport="tcp")
            self.assertTrue(any("'0'" in r and "sparse=True" in r and
                                "shardps.torch.Embedding" in r for r in logs.output), logs.output)
            ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
            x = torch.tensor([[1, 2], [3, 1]])
            for _ in range(3):
                opt.zero_grad()
                m(x).sum().backward()
                opt.step()
                ropt.zero_grad()
                ref(x).sum().backward()
                ropt.step()
            torch.testing.assert_close(m[0].weight, ref[0].weight)
            opt.close()


@unittest.skipIf(torch is None, "torch is not installed")
class EmbeddingStateDictTest(unittest.TestCase):
    """A model with row tables saved with torch.save(model.state_dict()) and
    opt.state_dict(), loaded into a fresh cluster (the model before or after the optimizer is
    built), trains on exactly as the run that never stopped: rows, optimizer state rows (lazy
    Adam's moments and step count, Adagrad's sums) and hashed keys travel."""
    ROWS, DIM, STEPS = 300, 8, 8

    def make(self, hashed, dtype=torch.float32):
        class M(torch.nn.Module):
            def __init__(s):
                super().__init__()
                s.emb = spt.Embedding(self.ROWS, self.DIM, optimizer="adam", lr=0.05,
                                      init="uniform", init_scale=0.1, init_seed=3, max_ids=64,
                                      dtype=dtype)
                s.tags = spt.Embedding(4096 if hashed else self.ROWS, self.DIM,
                                       optimizer="adagrad", lr=0.1,
                                       initial_accumulator_value=0.1, hashed=hashed,
                                       max_ids=64, init="uniform", init_scale=0.1)
                s.fc = torch.nn.Linear(2 * self.DIM, 1)

            def forward(s, a, t):
                return s.fc(torch.cat([s.emb(a).float().sum(1), s.tags(t).mean(1)], 1))

        torch.manual_seed(1)
        return M()

    def batches(self, hashed):
        g = torch.Generator().manual_seed(7)
        out = []
        for _ in range(2 * self.STEPS):
            a = torch.randint(0, self.ROWS, (16, 3), generator=g)
            t = torch.randint(0, self.ROWS, (16, 2), generator=g)
            out.append((a, t * 1000003 - 5 if hashed else t))
        return out

    def train(self, m, opt, batches):
        target = torch.linspace(-1, 1, 16).unsqueeze(1)
        losses = []
        for a, t in batches:
            opt.zero_grad()
            loss = ((m(a, t) - target) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return losses

    def opt(self, m, cl, overlap=False):
        return spt.DistributedOptimizer(torch.optim.Adam(m.fc.parameters(), lr=0.01), m,
                                        coordinator=cl.address, cluster_token=cl.token, rank=0,
                                        transport="tcp", overlap=overlap)

    def check(self, hashed, load_model_first, overlap=False, dtype=torch.float32):
        import io
        batches = self.batches(hashed)
        with cluster() as cl:  # the run that never stops
            m = self.make(hashed, dtype)
            opt = self.opt(m, cl)
            straight = self.train(m, opt, batches)
            opt.close()
        with cluster() as cl:  # the first half, saved
            m = self.make(hashed, dtype)
            opt = self.opt(m, cl, overlap)
            first = self.train(m, opt, batches[:self.STEPS])
            buf = io.BytesIO()
            torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
            opt.close()
        self.assertEqual(first, straight[:self.STEPS])
        buf.seek(0)
        saved = torch.load(buf)
        sd = saved["model"]
        self.assertEqual(tuple(sd["emb.weight"].shape), (self.ROWS, self.DIM))
        self.assertIn("emb", saved["opt"]["shardps_row_tables"])
        self.assertEqual(saved["opt"]["shardps_row_tables"]["emb"]["step"], self.STEPS)
        if hashed:
            touched = torch.unique(torch.cat([t.reshape(-1) for _, t in batches[:self.STEPS]]))
            self.assertTrue(torch.equal(sd["tags.keys"], touched), "the keys holding a row")
        else:
            # Plain torch takes the rows as they are (export for inference).
            plain = torch.nn.Embedding(self.ROWS, self.DIM)
            plain.load_state_dict({"weight": sd["tags.weight"]})
        if dtype != torch.float32:
            self.assertEqual(sd["emb.weight"].dtype, dtype)
            master = saved["opt"]["shardps_row_tables"]["emb"]["shardps_master"]
            self.assertEqual(master.dtype, torch.float32)
            self.assertTrue(torch.equal(master.to(dtype), sd["emb.weight"]))
            self.assertFalse(torch.equal(master, sd["emb.weight"].float()),
                             "the master holds more than the 16-bit rows")
        with cluster() as cl:  # a fresh cluster, resumed
            m = self.make(hashed, dtype)
            if load_model_first:
                m.load_state_dict(sd)  # before the optimizer: set once the client starts
                opt = self.opt(m, cl, overlap)
            else:
                opt = self.opt(m, cl, overlap)
                m.load_state_dict(sd)
            opt.load_state_dict(saved["opt"])
            second = self.train(m, opt, batches[self.STEPS:])
            opt.close()
        self.assertEqual(second, straight[self.STEPS:], "the resumed run trained differently")

    def test_dense_tables_resume_exactly_model_loaded_first(self):
        self.check(hashed=False, load_model_first=True)

    def test_hashed_table_resumes_exactly_model_loaded_after(self):
        self.check(hashed=True, load_model_first=False)

    def test_a_bfloat16_table_resumes_exactly(self):
        """A bfloat16 table: its rows in model.state_dict() are bfloat16, its float32 master
        rides in the optimizer's (shardps_master) and is set exactly, with the state rows."""
        self.check(hashed=False, load_model_first=True, dtype=torch.bfloat16)

    def test_overlapped_steps_save_and_resume_exactly(self):
        """overlap=True (the dense bucket pushed during backward, the tables at step()):
        saved right after a step and resumed, against the plain uninterrupted run."""
        self.check(hashed=False, load_model_first=True, overlap=True)

    def test_pretrained_rows_and_bad_shapes(self):
        with cluster() as cl:
            m = torch.nn.ModuleDict({"emb": spt.Embedding(10, 4, optimizer="sgd", lr=0.1),
                                     "fc": torch.nn.Linear(4, 1)})
            before = m.state_dict()["emb.weight"]  # the servers' initial rows, computed here
            opt = spt.DistributedOptimizer(torch.optim.SGD(m["fc"].parameters(), lr=0.1), m,
                                           coordinator=cl.address, cluster_token=cl.token,
                                           rank=0, transport="tcp")
            self.assertTrue(torch.equal(m["emb"](torch.arange(10)), before))
            pretrained = torch.arange(40, dtype=torch.float32).reshape(10, 4) / 8
            m.load_state_dict({"emb.weight": pretrained, "fc.weight": m["fc"].weight,
                               "fc.bias": m["fc"].bias})
            self.assertTrue(torch.equal(m["emb"](torch.tensor([7, 2])), pretrained[[7, 2]]))
            with self.assertRaises(RuntimeError) as e:
                m.load_state_dict({"emb.weight": torch.zeros(11, 4), "fc.weight": m["fc"].weight,
                                   "fc.bias": m["fc"].bias})
            self.assertIn("emb.weight", str(e.exception))
            with self.assertRaises(RuntimeError) as e:  # strict: a stray key of the table
                m.load_state_dict({"emb.weight": pretrained, "emb.keys": torch.arange(3),
                                   "fc.weight": m["fc"].weight, "fc.bias": m["fc"].bias})
            self.assertIn("emb.keys", str(e.exception))
            self.assertTrue(torch.equal(m["emb"](torch.tensor([7])), pretrained[[7]]))
            with self.assertRaises(shardps.Error) as e:
                opt.client.set_rows("emb", "weights", np.array([3, 3], np.int64),
                                    np.zeros((2, 4), np.float32))
            self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
            opt.close()


if __name__ == "__main__":
    unittest.main()
