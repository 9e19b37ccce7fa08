"""Tests of shardps.overlap.BucketedSync (pushes from backward hooks, fused buckets, pulls awaited
by forward pre-hooks) on real local clusters (shardps.launch.LocalCluster, tcp), asserting on
data: weights and losses against the non-overlapped path and against torch.optim.SGD, the
buckets' memory, and the order of the client calls against the forward and backward.

Two workers run as two threads of this process (each with its own Client; the client releases
the GIL while it blocks). Every run is bounded by the clients' wait_timeout_ms and a join
deadline. Run by ctest with the rest of tests/python (PYTHONPATH at BUILD/python)."""
import threading
import time
import unittest

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

import shardps
import shardps.launch

if torch is not None:
    import shardps.torch as spt
    from shardps.overlap import BucketedSync

LR = 0.5
DEADLINE_S = 60.0  # a run that has not finished by then hung


def connect(cl, **kw):
    return shardps.Client(cl.address, cluster_token=cl.token, transport="tcp",
                          bind_ip="127.0.0.1", setup_timeout_ms=20000, wait_timeout_ms=10000,
                          **kw)


def cluster(**kw):
    kw.setdefault("servers", 2)
    kw.setdefault("workers", 1)
    kw.setdefault("lr", LR)
    kw.setdefault("partition_bytes", 256)  # buckets cut into parts on both servers
    kw.setdefault("grace", 1.0)
    return shardps.launch.LocalCluster(**kw)


def mlp(seed, sizes=(8, 24, 16, 12, 3)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batches(seed, n=6, rows=16, d_in=8, d_out=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g))
            for _ in range(n)]


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def run_workers(fns):
    """Runs fns[r]() on thread r; returns their results, re-raising the first error. A thread
    still running after DEADLINE_S fails the test (the clients' own bounds are shorter)."""
    results, errors = [None] * len(fns), [None] * len(fns)

    def body(r):
        try:
            results[r] = fns[r]()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors[r] = e

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(fns))]
    for t in ts:
        t.start()
    end = time.monotonic() + DEADLINE_S
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    if any(t.is_alive() for t in ts):
        raise AssertionError(f"workers still running after {DEADLINE_S} s: a hang")
    for e in errors:
        if e is not None:
            raise e
    return results


def storage(t):
    """Address of the storage a tensor views (torch >= 2 calls it untyped_storage)."""
    return (t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()).data_ptr()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


class RecordingClient:
    """A shardps.Client that logs push/pull/wait/clock (with the tensor each handle is for)
    into a shared event list, for order assertions."""

    def __init__(self, client, events):
        self._c, self.events, self._name_of = client, events, {}

    def push(self, name):
        h = self._c.push(name)
        self._name_of[h] = ("push", name)
        self.events.append(("push", name))
        return h

    def pull(self, name):
        h = self._c.pull(name)
        self._name_of[h] = ("pull", name)
        self.events.append(("pull", name))
        return h

    def wait(self, h):
        kind, name = self._name_of.pop(h)
        self._c.wait(h)
        self.events.append(("wait-" + kind, name))

    def clock(self):
        self._c.clock()
        self.events.append(("clock", ""))

    def __getattr__(self, attr):
        return getattr(self._c, attr)


@unittest.skipIf(torch is None, "torch is not importable")
class BucketTest(unittest.TestCase):
    def test_buckets_are_views_registered_whole(self):
        """Buckets are formed in reverse order, never split a parameter nor mix groups; every
        parameter's .data and .grad are views into its bucket's two buffers, which are the
        registered memory, and stay so across pulls."""
        model = mlp(0)
        params = list(model.parameters())
        groups = [params[:4], params[4:]]
        bucket_bytes = 1024
        with cluster() as cl, connect(cl) as c:
            sync = BucketedSync(c, model.named_parameters(), groups=groups,
                                bucket_bytes=bucket_bytes)
            index = {id(p): i for i, p in enumerate(params)}
            group_of = {id(p): g for g, ps in enumerate(groups) for p in ps}
            seen = []
            for b in sync.buckets:
                self.assertEqual({group_of[id(s.param)] for s in b.slots}, {b.group})
                if len(b.slots) > 1:
                    self.assertLessEqual(sum(s.param.numel() for s in b.slots) * 4, bucket_bytes)
                seen += [s.param for s in b.slots]
            self.assertEqual(sorted(map(id, seen)), sorted(map(id, params)))  # each exactly once
            # Bucket 0 holds the last parameter; later buckets hold earlier parameters.
            self.assertIs(sync.buckets[0].slots[0].param, params[-1])
            tops = [max(index[id(s.param)] for s in b.slots) for b in sync.buckets]
            self.assertEqual(tops, sorted(tops, reverse=True))
            self.assertEqual(sorted(sync.names_of_group(0) + sync.names_of_group(1)),
                             sorted(sync.names))

            def check_views():
                for p in params:
                    b = sync.bucket_of(p)
                    s = sync._slot_of[id(p)]
                    self.assertEqual(p.data_ptr(), b.weights.data_ptr() + 4 * s.offset)
                    self.assertEqual(p.grad.data_ptr(), b.grads.data_ptr() + 4 * s.offset)
                    self.assertEqual(p.data_ptr() % 64, 0)
                    self.assertEqual(storage(p), storage(b.weights))
                    self.assertEqual(storage(p.grad), storage(b.grads))
                    self.assertTrue(torch.equal(p.detach().view(-1),
                                                b.weights[s.offset:s.offset + p.numel()]))

            check_views()
            sync.register()
            for b in sync.buckets:  # one tensor per bucket, registered without a copy
                self.assertEqual(c.registered_address(b.name),
                                 (b.weights.data_ptr(), b.grads.data_ptr()))
            c.start()
            sync.install(model)
            before = weights(model)
            for x, y in batches(1, n=3):
                sync.zero_grad()
                loss_of(model, x, y).backward()
                sync.finish_step()
            sync.synchronize()
            check_views()  # the pulls landed in the parameters themselves
            self.assertTrue(all(not torch.equal(a, p) for a, p in zip(before, params)))
            sync.close()


@unittest.skipIf(torch is None, "torch is not importable")
class EquivalenceTest(unittest.TestCase):
    def test_one_worker_matches_torch_sgd_with_groups_and_schedule(self):
        """One worker, two param groups with their own rate and a schedule that changes it every
        step: per-step losses and final weights equal torch.optim.SGD in this process.
        Tolerance 1e-5 (as TorchOptimizerSemanticsTest): with one worker the server computes
        w - lr*g on the same float32 values torch does, the two may differ only by the rounding
        of a fused multiply-add in torch's vectorised kernel, about an ulp per step."""
        model, ref = mlp(2), mlp(2)
        data = batches(3)
        mp, rp = list(model.parameters()), list(ref.parameters())
        ref_opt = torch.optim.SGD([{"params": rp[:2], "lr": 0.2}, {"params": rp[2:]}], lr=0.1)
        base = [0.2, 0.1]
        state = {"step": 0}
        with cluster() as cl, connect(cl) as c:
            def send_rates():  # what DistributedOptimizer._send_rules does
                for i, lr in enumerate(base):
                    for name in sync.names_of_group(i):
                        c.set_lr(name, lr / (1 + 0.1 * state["step"]))

            sync = BucketedSync(c, model.named_parameters(), groups=[mp[:2], mp[2:]],
                                bucket_bytes=512, before_push=send_rates)
            sync.register()
            c.start()
            sync.install(model)
            for step in range(30):
                state["step"] = step
                for g, lr in zip(ref_opt.param_groups, base):
                    g["lr"] = lr / (1 + 0.1 * step)
                x, y = data[step % len(data)]
                sync.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                sync.finish_step()
                ref_opt.zero_grad()
                ref_loss = loss_of(ref, x, y)
                ref_loss.backward()
                ref_opt.step()
                self.assertAlmostEqual(loss.item(), ref_loss.item(),
                                       delta=1e-5 * max(1.0, abs(ref_loss.item())),
                                       msg=f"step {step}")
            sync.synchronize()
            for p, q in zip(mp, rp):
                self.assertTrue(torch.allclose(p, q, rtol=1e-5, atol=1e-5), (p - q).abs().max())
            sync.close()

    def test_two_workers_with_a_straggler_equal_the_non_overlapped_path(self):
        """Two workers, rank 1 late every step (so rank 0's forward must wait in the pre-hooks
        for pulls that cannot complete before rank 1 pushes): per-step losses and final weights
        of both ranks are bit-identical to DistributedOptimizer without overlap. Exact, because
        the arithmetic is the same element by element: the same float32 forward and backward
        (the bucket views keep each parameter 64-byte aligned, as its own allocation is), and
        the servers sum the workers' gradients in rank order, whatever the chunking."""
        steps = 8
        data = [batches(10 + r) for r in range(2)]

        # Built here, not in the threads: torch's seed is global.
        models = {name: [mlp(4) for _ in range(2)] for name in ("overlap", "plain")}

        def overlapped(cl, r):
            model = models["overlap"][r]
            with connect(cl, rank=r) as c:
                sync = BucketedSync(c, model.named_parameters(), bucket_bytes=512)
                sync.register()
                c.start()
                sync.install(model)
                losses = []
                for step in range(steps):
                    x, y = data[r][step % len(data[r])]
                    sync.zero_grad()
                    loss = loss_of(model, x, y)
                    if r == 1:
                        time.sleep(0.05)  # the straggler: its pushes come late
                    loss.backward()
                    sync.finish_step()
                    losses.append(loss.item())
                sync.synchronize()
                sync.close()
                return losses, weights(model)

        def plain(cl, r):
            model = models["plain"][r]
            opt = spt.DistributedOptimizer(model, client=connect(cl, rank=r))
            losses = []
            for step in range(steps):
                x, y = data[r][step % len(data[r])]
                opt.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            opt.close()
            return losses, weights(model)

        results = {}
        for name, fn in (("overlap", overlapped), ("plain", plain)):
            with cluster(workers=2) as cl:
                results[name] = run_workers([lambda r=r: fn(cl, r) for r in range(2)])
        for r in range(2):
            ov_losses, ov_w = results["overlap"][r]
            pl_losses, pl_w = results["plain"][r]
            self.assertEqual(ov_losses, pl_losses, f"rank {r}")
            for a, b in zip(ov_w, pl_w):
                self.assertTrue(torch.equal(a, b), f"rank {r}: {(a - b).abs().max()}")
        for a, b in zip(results["overlap"][0][1], results["overlap"][1][1]):
            self.assertTrue(torch.equal(a, b))


@unittest.skipIf(torch is None, "torch is not importable")
class StepProtocolTest(unittest.TestCase):
    def test_unused_parameters_are_pushed_and_nothing_hangs(self):
        """A layer used on even steps only and a parameter never used: their buckets are pushed
        (zeros) at finish_step every step, so every bucket is in every clock: the pushed bytes
        are exactly steps x model bytes, and the servers' momentum and weight decay run on for
        them as torch's SGD with zeroed (not None) gradients does (a bucket missing from a
        clock is not updated), and the run ends well within its bound. Tolerance 1e-5 as above
        (momentum and decay add a few multiply-adds per step, still ulps)."""

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(8, 12)
                self.sometimes = torch.nn.Linear(12, 12)
                self.never = torch.nn.Parameter(torch.ones(5))
                self.b = torch.nn.Linear(12, 3)
                self.step = 0

            def forward(self, x):
                h = torch.tanh(self.a(x))
                if self.step % 2 == 0:
                    h = torch.tanh(self.sometimes(h))
                return self.b(h)

        torch.manual_seed(5)
        model = Net()
        ref = Net()
        ref.load_state_dict(model.state_dict())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)
        for q in ref.parameters():  # zero gradients, not None, as the pushes of zeros are
            q.grad = torch.zeros_like(q)
        data = batches(6)
        steps = 12
        t0 = time.monotonic()
        with cluster(optimizer="momentum", lr=0.1,
                     extra_server_args=("--momentum=0.9", "--weight_decay=0.05")) as cl, \
                connect(cl) as c:
            # Small buckets: `never` and `sometimes` have buckets of their own.
            sync = BucketedSync(c, model.named_parameters(), bucket_bytes=256)
            self.assertTrue(any(len(b.slots) == 1 and b.slots[0].param is model.never
                                for b in sync.buckets))
            sync.register()
            c.start()
            sync.install(model)
            pushed0 = c.counters()["bytes_pushed"]
            for step in range(steps):
                x, y = data[step % len(data)]
                for m, opt in ((model, None), (ref, ref_opt)):
                    m.step = step
                    if opt is None:
                        sync.zero_grad()
                        loss_of(m, x, y).backward()
                        sync.finish_step()
                    else:
                        opt.zero_grad(set_to_none=False)
                        loss_of(m, x, y).backward()
                        opt.step()
            sync.synchronize()
            total = sum(b.nbytes for b in sync.buckets)
            self.assertEqual(c.counters()["bytes_pushed"] - pushed0, steps * total)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                self.assertTrue(torch.allclose(p, q, rtol=1e-5, atol=1e-5),
                                f"{n}: {(p - q).abs().max()}")
            self.assertTrue(torch.all(model.never.detach() < 0.99))  # decayed: pushed
            sync.close()
        self.assertLess(time.monotonic() - t0, 20.0)

    def test_gradient_accumulation_pushes_once_per_step(self):
        """Three micro-batches per step, the first two in no_sync(): one push per bucket per
        step, and the weights of torch.optim.SGD on the summed gradients (tolerance 1e-5 as
        above). A second backward after the push, outside no_sync, is an error, not a second
        push into the same clock."""
        model, ref = mlp(7), mlp(7)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        data = batches(8, n=9)
        steps = 6
        with cluster() as cl, connect(cl) as c:
            sync = BucketedSync(c, model.named_parameters(), bucket_bytes=512)
            sync.register()
            c.start()
            sync.install(model)
            pushed0 = c.counters()["bytes_pushed"]
            for step in range(steps):
                micro = [data[(3 * step + k) % len(data)] for k in range(3)]
                sync.zero_grad()
                with sync.no_sync():
                    for x, y in micro[:2]:
                        loss_of(model, x, y).backward()
                    self.assertEqual([b.pushed for b in sync.buckets],
                                     [False] * len(sync.buckets))
                loss_of(model, *micro[2]).backward()
                sync.finish_step()
                ref_opt.zero_grad()
                for x, y in micro:
                    loss_of(ref, x, y).backward()
                ref_opt.step()
            self.assertEqual(c.counters()["bytes_pushed"] - pushed0,
                             steps * sum(b.nbytes for b in sync.buckets))
            sync.synchronize()
            for p, q in zip(model.parameters(), ref.parameters()):
                self.assertTrue(torch.allclose(p, q, rtol=1e-5, atol=1e-5), (p - q).abs().max())
            sync.zero_grad()
            x, y = data[0]
            loss_of(model, x, y).backward()
            with self.assertRaisesRegex(RuntimeError, "no_sync"):
                loss_of(model, x, y).backward()
            sync.close()

    def test_parameters_used_by_a_parent_are_awaited_before_the_parent(self):
        """nn.MultiheadAttention reads out_proj's parameters without calling out_proj: its
        bucket is awaited before the attention module (learnt in the first forward), so the
        weights equal torch.optim.SGD's (tolerance 1e-5 as above) and no gradient meets a
        pull in flight."""

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = torch.nn.Linear(8, 16)
                self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
                self.out = torch.nn.Linear(16, 3)

            def forward(self, x):
                h = torch.tanh(self.inp(x))
                h, _ = self.attn(h, h, h, need_weights=False)
                return self.out(h)

        torch.manual_seed(11)
        model, ref = Net(), Net()
        ref.load_state_dict(model.state_dict())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(12)
        data = [(torch.randn(4, 5, 8, generator=g), torch.randn(4, 5, 3, generator=g))
                for _ in range(4)]
        with cluster(lr=0.1) as cl, connect(cl) as c:
            sync = BucketedSync(c, model.named_parameters(), bucket_bytes=512)
            out_proj = sync.bucket_of(model.attn.out_proj.weight)
            self.assertNotIn(out_proj, [sync.bucket_of(p) for p in
                                        model.attn.parameters(recurse=False)])
            sync.register()
            c.start()
            sync.install(model)
            for step in range(10):
                x, y = data[step % len(data)]
                sync.zero_grad()
                loss_of(model, x, y).backward()
                sync.finish_step()
                ref_opt.zero_grad()
                loss_of(ref, x, y).backward()
                ref_opt.step()
            self.assertIn(out_proj, sync._waits[id(model.attn)])
            sync.synchronize()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                self.assertTrue(torch.allclose(p, q, rtol=1e-5, atol=1e-5),
                                f"{n}: {(p - q).abs().max()}")
            sync.close()

    def test_pushes_overlap_backward_and_each_pull_is_awaited_just_before_its_layer(self):
        """The order of the client calls: during backward each bucket is pushed as soon as
        complete (the last layer's before the first layer's gradient even exists), in backward
        order; finish_step clocks after every push, then issues the pulls in forward order;
        each pull is awaited immediately before the first module that uses its bucket runs."""
        model = mlp(9, sizes=(32, 32, 32, 32))
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        events = []
        with cluster() as cl, connect(cl) as real:
            c = RecordingClient(real, events)
            # One bucket per Linear: each layer's weight and bias fill a bucket exactly.
            sync = BucketedSync(c, model.named_parameters(), bucket_bytes=(32 * 32 + 32) * 4)
            sync.register()
            c.start()
            sync.install(model)
            bucket_of_layer = [sync.bucket_of(m.weight).name for m in linears]
            self.assertEqual(len(set(bucket_of_layer)), len(linears))
            for i, m in enumerate(linears):  # after the sync's own pre-hooks
                m.register_forward_pre_hook(lambda *_, i=i: events.append(("forward", i)))
            linears[0].weight.register_hook(lambda g: events.append(("grad", 0)))
            for x, y in batches(10, n=3, d_in=32, d_out=32):
                sync.zero_grad()
                events.append(("step", ""))
                loss = loss_of(model, x, y)
                events.append(("backward", ""))
                loss.backward()
                events.append(("finish", ""))
                sync.finish_step()
            sync.close()
        steps = [[]]
        for e in events[events.index(("step", "")) + 1:]:
            if e == ("step", ""):
                steps.append([])
            else:
                steps[-1].append(e)
        backward_order = list(reversed(bucket_of_layer))
        forward_order = bucket_of_layer
        for k, ev in enumerate(steps):
            b, f = ev.index(("backward", "")), ev.index(("finish", ""))
            # Pushed during backward, in backward order, the last layer's before layer 0's
            # gradient was computed.
            self.assertEqual([n for op, n in ev[b:f] if op == "push"], backward_order, ev)
            self.assertLess(ev.index(("push", backward_order[0])), ev.index(("grad", 0)))
            after = ev[f + 1:]
            self.assertEqual(after[0], ("clock", ""), ev)
            self.assertEqual([n for op, n in after if op == "pull"], forward_order, ev)
            if k == 0:
                continue  # the first forward uses the weights start() pulled
            # Pulls issued at the end of the previous step are awaited in this forward, each
            # right before its layer, not earlier.
            fwd = ev[:b]
            for i, name in enumerate(forward_order):
                w = fwd.index(("wait-pull", name))
                self.assertEqual(fwd[w + 1], ("forward", i), fwd)
                if i > 0:
                    self.assertLess(fwd.index(("forward", i - 1)), w, fwd)


if __name__ == "__main__":
    unittest.main()
