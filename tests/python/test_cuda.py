"""A GPU learner's PyTorch flows, with the model on the GPU (CUDA tensors registered without a copy
of their own: the client stages them through pinned host mirrors on tcp and shm). Each test
asserts on data against plain torch: losses and weights after N steps. Skipped, with the reason,
where torch has no CUDA or no GPU is present (every machine of this project's CI: Debian's torch
is CPU-only); scripts/gpu-check.sh runs them on a GPU machine (docs/python.md, "GPU learners").
"""
import os
import unittest

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

import shardps
import shardps.launch
from test_overlap import run_workers  # noqa: E402 (tests/python is on sys.path under pytest)

HAVE_CUDA = torch is not None and torch.cuda.is_available()
# SHARDPS_TEST_DEVICE=cpu runs the same tests on the CPU (a check of the tests themselves on a
# machine without a GPU; the CUDA staging is then not exercised).
DEVICE = os.environ.get("SHARDPS_TEST_DEVICE") or ("cuda" if HAVE_CUDA else None)
if torch is not None:
    import shardps.torch as spt

def cluster(**kw):
    kw.setdefault("servers", 2)
    kw.setdefault("workers", 1)
    kw.setdefault("partition_bytes", 1024)  # several chunks per tensor, on both servers
    kw.setdefault("grace", 1.0)
    return shardps.launch.LocalCluster(**kw)


def connect(cl, **kw):
    return shardps.Client(cl.address, cluster_token=cl.token, transport="tcp",
                          bind_ip="127.0.0.1", setup_timeout_ms=30000, wait_timeout_ms=20000,
                          **kw)


def mlp(seed, sizes=(16, 64, 32, 4)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batches(seed, n=5, rows=32, d_in=16, d_out=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d_in, generator=g).to(DEVICE),
             torch.randn(rows, d_out, generator=g).to(DEVICE)) for _ in range(n)]


class FakeCudaTensor:
    """Duck-types a CUDA torch tensor whose memory is really host memory: what the module would
    get from a CUDA tensor that this shardps cannot use (a build without CUDA, no driver)."""

    def __init__(self, n):
        import numpy as np
        self._keep = np.zeros(n, dtype=np.float32)
        self.dtype = "torch.float32"
        self.shape = (n,)
        self.is_cuda = True

    def data_ptr(self):
        return self._keep.ctypes.data

    def is_contiguous(self):
        return True


class NotDeviceMemoryTest(unittest.TestCase):
    def test_a_cuda_tensor_the_library_cannot_see_is_refused_before_registration(self):
        """Registered as host memory, its device pointers would be read by the transport's CPU
        (a crash, or garbage weights). The module refuses it, saying why, in every build; the
        client stays usable."""
        with cluster(servers=1, lr=0.5) as cl:
            c = connect(cl)
            with self.assertRaises(ValueError) as e:
                c.register("w", FakeCudaTensor(16), FakeCudaTensor(16))
            msg = str(e.exception)
            self.assertIn("'w' is a CUDA tensor", msg)
            self.assertIn("built without CUDA" if not shardps.built_with_cuda()
                          else "does not see its memory as device memory", msg)
            import numpy as np
            w, g = np.zeros(16, dtype=np.float32), np.ones(16, dtype=np.float32)
            c.register("w", w, g)  # the name is still free: nothing was registered
            c.start()
            c.step()
            np.testing.assert_array_equal(w, np.full(16, -0.5, dtype=np.float32))
            c.close()


@unittest.skipUnless(torch is not None and DEVICE,
                     "no CUDA: torch has no CUDA support or no GPU is present")
class GpuLearnerTest(unittest.TestCase):
    def test_adam_with_a_scheduler_matches_torch_on_the_gpu(self):
        """One worker, a CUDA model, torch.optim.Adam (weight decay) under a StepLR schedule
        that halves the rate every 4 steps: the losses and weights follow torch's own Adam on the
        same GPU model (the servers apply Adam in float32 on the host; torch's CUDA kernel
        rounds differently, hence the tolerance)."""
        steps = 12
        model, ref = mlp(1).to(DEVICE), mlp(1).to(DEVICE)
        data = batches(2)
        with cluster() as cl:
            opt = spt.DistributedOptimizer(
                torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01), model,
                client=connect(cl))
            self.assertEqual({opt.client.tensor_path(n) for n, _, _ in opt._params},
                             {"cuda-staged" if DEVICE == "cuda" else "host"})
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
            ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.01)
            ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5)
            ours, theirs = [], []
            for step in range(steps):
                x, y = data[step % len(data)]
                for m, o, sch, out in ((model, opt, sched, ours), (ref, ref_opt, ref_sched, theirs)):
                    o.zero_grad()
                    loss = torch.nn.functional.mse_loss(m(x), y)
                    loss.backward()
                    o.step()
                    sch.step()
                    out.append(loss.item())
            opt.close()
        for a, b in zip(ours, theirs):
            self.assertAlmostEqual(a, b, delta=1e-4 * max(1.0, abs(b)))
        for p, q in zip(model.parameters(), ref.parameters()):
            self.assertEqual(p.device.type, DEVICE)
            self.assertTrue(torch.allclose(p, q, rtol=1e-4, atol=1e-5), (p - q).abs().max())
        self.assertLess(ours[-1], ours[0])

    def test_state_dict_round_trips_through_a_gpu_model(self):
        """Adam on a GPU model: 8 steps through ShardPS, state_dict(), then 8 more steps in a
        fresh cluster after load_state_dict() (the weights and Adam's moments copied from the
        GPU tensors into a host float32 buffer and set from there), against 16 uninterrupted steps of plain torch
        on the GPU."""
        data = batches(6)

        def train(model, opt, start, steps):
            for step in range(start, start + steps):
                x, y = data[step % len(data)]
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()

        make = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
        ref = mlp(8).to(DEVICE)
        ref_opt = make(ref)
        train(ref, ref_opt, 0, 16)
        with cluster() as cl:
            model = mlp(8).to(DEVICE)
            opt = spt.DistributedOptimizer(make(model), model, client=connect(cl))
            train(model, opt, 0, 8)
            sd = opt.state_dict()
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            opt.close()
        with cluster() as cl:
            model = mlp(99).to(DEVICE)  # other initial weights: everything must come from sd
            opt = spt.DistributedOptimizer(make(model), model, client=connect(cl))
            model.load_state_dict(weights)
            opt.load_state_dict(sd)
            train(model, opt, 8, 8)
            opt.close()
        for p, q in zip(model.parameters(), ref.parameters()):
            self.assertEqual(p.device.type, DEVICE)
            self.assertTrue(torch.allclose(p, q, rtol=1e-4, atol=1e-5), (p - q).abs().max())

    def test_two_gpu_workers_overlap_equals_plain(self):
        """Two workers on the GPU (threads of this process), momentum SGD: overlap=True (fused
        CUDA buckets pushed from backward hooks) ends with the losses and weights of the
        non-overlapped optimizer, bit for bit, and both ranks hold the same weights."""
        steps = 6
        data = [batches(10 + r) for r in range(2)]
        models = {k: [mlp(4).to(DEVICE) for _ in range(2)] for k in ("overlap", "plain")}

        def worker(cl, kind, r):
            model = models[kind][r]
            opt = spt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                client=connect(cl, rank=r), overlap=(kind == "overlap"), bucket_bytes=4096)
            losses = []
            for step in range(steps):
                x, y = data[r][step % len(data[r])]
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            opt.close()
            return losses, [p.detach().cpu().clone() for p in model.parameters()]

        results = {}
        for kind in ("overlap", "plain"):
            with cluster(workers=2) as cl:
                results[kind] = run_workers([lambda r=r: worker(cl, kind, r) for r in range(2)])
        for r in range(2):
            self.assertEqual(results["overlap"][r][0], results["plain"][r][0], f"rank {r}")
            for a, b in zip(results["overlap"][r][1], results["plain"][r][1]):
                self.assertTrue(torch.equal(a, b), f"rank {r}: {(a - b).abs().max()}")
        for a, b in zip(results["plain"][0][1], results["plain"][1][1]):
            self.assertTrue(torch.equal(a, b))

    def test_embedding_with_cuda_ids_next_to_a_gpu_layer(self):
        """shardps.torch.Embedding fed CUDA ids, returning CUDA rows to a dense layer on the GPU,
        Adagrad rows on the servers: the losses and the rows follow torch's sparse embedding
        with torch.optim.Adagrad, computed on the CPU."""
        rows_n, dim, steps = 500, 8, 15
        torch.manual_seed(3)
        fc0 = torch.nn.Linear(3 * dim, 1).state_dict()
        g = torch.Generator().manual_seed(4)
        ids = [torch.randint(0, rows_n, (16, 3), generator=g) for _ in range(steps)]
        target = torch.linspace(-1, 1, 16).unsqueeze(1)

        class M(torch.nn.Module):
            def __init__(s):
                super().__init__()
                s.emb = spt.Embedding(rows_n, dim, optimizer="adagrad", lr=0.1, init="uniform",
                                      init_scale=0.1, init_seed=7)
                s.fc = torch.nn.Linear(3 * dim, 1)
                s.fc.load_state_dict(fc0)

            def forward(s, a):
                return s.fc(s.emb(a).flatten(1))

        ours = []
        with cluster() as cl:
            m = M().to(DEVICE)
            opt = spt.DistributedOptimizer(torch.optim.SGD(m.fc.parameters(), lr=0.05), m,
                                           client=connect(cl))
            for a in ids:
                opt.zero_grad()
                out = m(a.to(DEVICE))
                self.assertEqual(out.device.type, DEVICE)
                loss = ((out - target.to(DEVICE)) ** 2).mean()
                loss.backward()
                opt.step()
                ours.append(loss.item())
            with torch.no_grad():
                got_rows = m.emb(torch.arange(rows_n).to(DEVICE)).cpu()
            opt.close()

        ref_emb = torch.nn.Embedding(rows_n, dim, sparse=True)
        with torch.no_grad():
            import numpy as np
            ref_emb.weight.copy_(torch.from_numpy(shardps.row_init(
                "uniform", 0.1, 7, np.arange(rows_n, dtype=np.int64), dim)))
        ref_fc = torch.nn.Linear(3 * dim, 1)
        ref_fc.load_state_dict(fc0)
        opts = [torch.optim.Adagrad(ref_emb.parameters(), lr=0.1),
                torch.optim.SGD(ref_fc.parameters(), lr=0.05)]
        theirs = []
        for a in ids:
            for o in opts:
                o.zero_grad()
            loss = ((ref_fc(ref_emb(a).flatten(1)) - target) ** 2).mean()
            loss.backward()
            for o in opts:
                o.step()
            theirs.append(loss.item())
        for a, b in zip(ours, theirs):
            self.assertAlmostEqual(a, b, delta=1e-4 * max(1.0, abs(b)))
        self.assertTrue(torch.allclose(got_rows, ref_emb.weight.detach(), atol=2e-5))

    def test_bfloat16_model_on_the_gpu_keeps_float32_masters(self):
        """A bfloat16 model on the GPU travels as 16 bits (cuda-staged, 2-byte elements); the
        servers keep float32 masters: after each SGD step the GPU weights are the float32 master
        (w0 - lr * sum of the gradients so far, in float32) rounded to bfloat16, not the
        bfloat16 weight minus the update rounded step by step."""
        model = torch.nn.Linear(64, 32, bias=False).to(DEVICE).to(torch.bfloat16)
        lr = 0.01
        with cluster(servers=1, lr=lr, optimizer="sgd") as cl:
            opt = spt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model,
                                           client=connect(cl))
            master = model.weight.detach().float().cpu().clone()
            g = torch.Generator().manual_seed(0)
            for step in range(5):
                grad = (torch.randn(32, 64, generator=g) * 0.5).to(torch.bfloat16)
                model.weight.grad.copy_(grad.to(DEVICE))
                opt.step()
                master = master - lr * grad.float()
                got = model.weight.detach().cpu()
                self.assertEqual(got.dtype, torch.bfloat16)
                want = master.to(torch.bfloat16)
                diff = (got.float() - want.float()).abs()
                # Equal, up to a last-place rounding where the server's float32 arithmetic and
                # torch's differ by an ulp of float32 near a bfloat16 tie.
                ulp = want.float().abs() * 2.0 ** -7
                self.assertTrue(bool((diff <= ulp).all()), f"step {step}: {diff.max()}")
                self.assertGreater(float((diff == 0).float().mean()), 0.99)
            opt.close()


if __name__ == "__main__":
    unittest.main()
