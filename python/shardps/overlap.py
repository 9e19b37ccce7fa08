"""Overlap of communication with backward and forward (issue item 3): BucketedSync.

Each gradient is pushed as soon as autograd has produced it, fused into buckets; each layer's
pull is awaited only just before that layer runs. DistributedOptimizer(overlap=True) delegates
to this class; it can also be driven directly (tests/python/test_overlap.py,
scripts/bench-overlap.py).

    sync = BucketedSync(client, model.named_parameters(), groups=[[...], [...]],
                        bucket_bytes=1 << 20, before_push=send_rates)
    sync.register()            # instead of one client.register per parameter; before start()
    client.start()             # rank 0's weights land in the bucket buffers, hence the model
    sync.install(model)        # gradient hooks, and a forward pre-hook on every module
    for x, y in batches:
        sync.zero_grad()
        loss_fn(model(x), y).backward()   # buckets are pushed while backward runs
        sync.finish_step()     # push what is left, clock, issue the pulls (not awaited here)
    sync.synchronize()         # before reading weights outside the model's forward
    sync.close()

How DistributedOptimizer(overlap=True, bucket_bytes=B) calls it:

    __init__   sync = BucketedSync(client, named, groups=[g["params"] for g in
               self.param_groups], bucket_bytes=B, before_push=self._send_rules);
               sync.register() (no per-parameter register); client.start(); sync.install(model)
               (model=None when given named parameters only: pulls are then awaited in
               finish_step, so only backward overlaps).
    _send_rules  for i, g in enumerate(self.param_groups): for name in sync.names_of_group(i):
               client.set_lr(name, g["lr"]) (and set_rule): the servers read the rate and rule
               of a tensor when it is pushed, and the first push now happens inside backward,
               so they must be set before it. before_push is called once per step, just before
               the step's first push (from a gradient hook, or from finish_step).
    tables     sync.step_pushes = [table names]: each row table (shardps.torch.Embedding,
               EmbeddingBag) is pushed whole in finish_step, after the buckets and before the
               clock: its sparse gradient is complete only when backward is.
    zero_grad  sync.zero_grad()       step  sync.finish_step()      no_sync  sync.no_sync()
    close      sync.close(); client.close()   (and sync.synchronize() in state_dict-like
               paths that read the weights)

Buckets. Parameters are taken in reverse registration order (backward produces the last
layers' gradients first) and packed, per parameter group, into buckets of at most
`bucket_bytes` (a larger parameter is a bucket of its own; a parameter is never split; a
bucket never mixes groups, so per-group rates and rules can be set per bucket). Each bucket
owns one flat float32 buffer for the weights and one for the gradients; every parameter's
.data and .grad are views into them (as DDP's gradient_as_bucket_view), each at an offset
aligned to 64 bytes (as a parameter's own allocation would be, so kernels see the same
alignment as without buckets; the few padding floats travel with the bucket, their gradient
is always 0). Each bucket is registered as ONE ShardPS tensor, so no gradient or weight is
ever copied: the pushes read the gradient buffer, the pulls write the weight buffer. The
coordinator's shard plan cuts a bucket larger than its --partition_bytes into near-equal
parts, a multiple of the number of servers: start the cluster with partition_bytes <=
bucket_bytes / servers (partition_bytes_for()) for Herring-style balanced parts of every
bucket on every server; with the default (4 MiB) each smaller bucket lives whole on one
server (buckets are still spread over the servers, largest first to the least loaded).

Step protocol (shardps/client.h; one worker's view of a BSP clock t):
  * backward: a post-accumulate-grad hook per parameter (Tensor.register_post_accumulate_grad_hook
    where torch has it, else a hook on the parameter's AccumulateGrad node, as DDP and Horovod
    do on torch 1.13) counts the bucket's ready gradients; when the last one is in, the bucket
    is pushed (client.push: the writes are posted at once; the tcp provider sends inline and
    its progress thread finishes the send, verbs hands them to the NIC). The servers apply a
    chunk of clock t as soon as every worker has pushed it (or clocked past it), so the update
    of the last layers runs while this worker still computes the first layers' gradients.
  * finish_step: buckets not pushed yet (parameters without a gradient this step: unused,
    frozen, or a backward that did not reach them) are pushed with what their gradient buffer
    holds (zeros after zero_grad(); a parameter whose .grad is None gets zeros), so no bucket
    is ever missing from a clock. Then client.clock() (it must follow every push of the
    clock: a chunk this worker has not pushed by its clock is applied without it), then the
    pulls are issued, all of them, in the order the forward used the buckets last step (first
    step: registration order), then the pushes are waited for (their gradient buffers may be
    rewritten after that; the pulls progress meanwhile).
  * forward: a pre-hook on every module waits for the pulls of the buckets holding the
    module's own parameters, just before the module runs. A pull in flight writes its
    bucket's weight buffer (possibly a torn or not-yet-published version that it then reads
    again), so nothing may read those weights before the wait. Some modules use a child's
    parameters without calling the child (nn.MultiheadAttention reads out_proj.weight
    itself): the first forward after install() records which modules run (its first module
    waits for every pull, so that forward is safe), and from then on the buckets of a module
    that did not run are awaited before its nearest ancestor that did. Parameters read
    outside any module's forward need synchronize() first. A gradient that arrives for a
    bucket whose pull is still in flight proves the rule was broken and raises RuntimeError.
  * gradient accumulation: inside `with sync.no_sync():` the hooks do nothing (gradients just
    accumulate in the bucket buffers); the backward after it pushes. A hook firing for a bucket
    already pushed this step (a second backward outside no_sync) raises RuntimeError instead
    of pushing twice in one clock.

What is prioritised, and what is not:
  * pulls: issued in forward order (by the order the last forward waited for them), so on
    every server connection the reads of the buckets needed first are posted first (endpoints
    execute in post order), and each is awaited only when its module runs. Waiting for one
    pull polls the completions of all, so later pulls progress too.
  * pushes: posted in the order buckets complete, which in backward is the reverse layer order
    (the last layers' buckets exist first); the buckets finish_step pushes go in forward order.
    A posted push is not preempted (ByteScheduler/P3 slice and preempt; here a write posted to
    an endpoint goes before anything posted after it, and the client offers no non-blocking
    test of a handle, so a credit window over pushes could not be kept from Python without
    blocking the backward). Smaller buckets (bucket_bytes) are the knob that lets the first
    layers' gradients, produced last, queue behind less.

Limits of the client this works within (shardps/client.h, worker/pull_pipeline.cc):
  * The client has no progress thread of its own: completions are evaluated only inside a
    client call (Wait, or a post that waits for credits). A pull posted before its version is
    published (BSP: another worker has not pushed yet) reads the old header, and is read again
    only when the trainer next waits; so such a pull's remaining round trips happen in the
    pre-hook's wait, not under the compute before it. The reads of a pull whose version is
    already there when posted arrive meanwhile (the transport delivers them by itself); the
    wait then only checks them.
  * Step() on a replicated ASP/SSP cluster waits for the servers' acknowledgements of its
    pushes ("Step() never loses a push", docs/fault-tolerance.md); the public API has no such
    call, so here, as with any push()/wait() caller, a push of those modes whose primary dies
    before replicating it is counted in counters()["pushes_lost"] instead of being resent. BSP
    is not affected (its pull implies the push was replicated).

Thread safety: one training thread, like shardps.Client; the hooks run on the thread that
calls backward() and forward().
"""
import contextlib
import logging

import torch

log = logging.getLogger("shardps")

DEFAULT_BUCKET_BYTES = 1 << 20
_ALIGN_FLOATS = 16  # 64 bytes


def partition_bytes_for(bucket_bytes, num_servers):
    """The coordinator's --partition_bytes that cuts every full bucket into one near-equal part
    per server (LocalCluster(partition_bytes=...), python -m shardps.run --partition-bytes)."""
    return max(4, (bucket_bytes // max(1, num_servers)) // 4 * 4)


class _Slot:
    """One parameter: where it lives in its bucket."""
    __slots__ = ("name", "param", "index", "bucket", "offset", "numel", "grad_view", "ready")

    def __init__(self, name, param, index):
        self.name, self.param, self.index = name, param, index
        self.bucket = None
        self.offset = self.numel = 0
        self.grad_view = None
        self.ready = False


class Bucket:
    """Parameters fused into one registered tensor (`name`): flat weight and grad buffers."""

    def __init__(self, index, group, slots):
        self.index = index
        self.name = f"overlap.bucket{index:03d}"
        self.group = group
        self.slots = slots
        self.weights = None  # flat float32, registered as the tensor's weights
        self.grads = None    # flat float32, registered as its gradients
        self.trainable = sum(1 for s in slots if s.param.requires_grad)
        self.no_grad_sent = False  # the client's SetNoGradient mark of this bucket
        self.ready = 0
        self.pushed = False
        self.push = None     # handle of this step's push, until waited for
        self.pull = None     # handle of the pull in flight, until waited for

    @property
    def nbytes(self):
        return self.weights.numel() * 4

    @property
    def first_index(self):
        """Registration index of its first parameter (lower: used earlier by the forward)."""
        return min(s.index for s in self.slots)

    def __repr__(self):
        return (f"Bucket({self.name}, group {self.group}, {self.nbytes} bytes, "
                f"{[s.name for s in self.slots]})")


class BucketedSync:
    """Pushes fused gradient buckets from backward hooks and awaits each pull in a forward
    pre-hook (the module comment has the protocol).

    client        a shardps.Client, not started
    named_params  (name, parameter) pairs in registration order (model.named_parameters())
    groups        optional list of parameter lists (the optimizer's param groups): a bucket
                  never mixes them; default: one group
    bucket_bytes  most bytes per bucket (a single larger parameter gets a bucket of its own)
    before_push   called with no argument once per step, before the step's first push (set the
                  rates and rules of names_of_group(i) there)
    lazy_pulls    True: each pull is awaited by the forward pre-hooks; False: finish_step
                  waits for all of them (no overlap with forward)
    """

    def __init__(self, client, named_params, groups=None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 before_push=None, lazy_pulls=True):
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be > 0")
        named = list(named_params)
        if not named:
            raise ValueError("no parameters")
        self.client = client
        self.bucket_bytes = int(bucket_bytes)
        self._before_push = before_push
        self.lazy_pulls = lazy_pulls
        self._slots = [_Slot(n, p, i) for i, (n, p) in enumerate(named)]
        seen = set()
        for s in self._slots:
            p = s.param
            if id(p) in seen:
                raise ValueError(f"parameter '{s.name}' is named twice")
            seen.add(id(p))
            if p.dtype != torch.float32:
                raise TypeError(f"parameter '{s.name}' is {p.dtype}; ShardPS trains float32")
        group_of = self._group_of(groups)
        self.buckets = self._form_buckets(group_of)
        for b in self.buckets:
            self._allocate(b)
        self._slot_of = {id(s.param): s for s in self._slots}
        self._pull_order = sorted(self.buckets, key=lambda b: b.first_index)
        self._seen_order = []       # buckets in the order this forward waited for them
        self._hooks = []
        self._grad_accs = []        # AccumulateGrad nodes kept alive (their hooks live on them)
        self._sync_grads = True
        self._prepared = False      # before_push called this step
        # Tensors pushed whole at the end of every step, before the clock: row tables, whose
        # sparse gradients the backward pass added to the client (DistributedOptimizer sets it).
        self.step_pushes = []
        self._step_handles = []
        self._registered = False
        self._warned_replaced = False
        self._modules_hooked = False
        self._waits = {}            # id(module) -> the buckets its pre-hook waits for
        self._modules = {}
        self._parent = {}
        self._recording = False     # the first forward after install(): which modules run
        self._ran = set()

    # ---- construction ----

    def _group_of(self, groups):
        if groups is None:
            return {id(s.param): 0 for s in self._slots}
        group_of, ours = {}, {id(s.param) for s in self._slots}
        for i, ps in enumerate(groups):
            for p in ps:
                if id(p) not in ours:
                    raise ValueError(f"group {i} names a tensor that is not a parameter")
                if id(p) in group_of:
                    raise ValueError(f"a parameter is in groups {group_of[id(p)]} and {i}")
                group_of[id(p)] = i
        missing = [s.name for s in self._slots if id(s.param) not in group_of]
        if missing:
            raise ValueError(f"parameters in no group: {missing}")
        return group_of

    def _form_buckets(self, group_of):
        # Reverse registration order; one open bucket per group, and frozen parameters
        # (requires_grad=False) in buckets of their own, which every step pushes with the
        # no-gradient mark (so the servers leave them as they are); a bucket is closed when the
        # next parameter would take it past bucket_bytes.
        cap = max(1, self.bucket_bytes // 4)
        closed, open_, size = [], {}, {}
        for s in reversed(self._slots):
            g = (group_of[id(s.param)], s.param.requires_grad)
            cur = open_.setdefault(g, [])
            n = _aligned(s.param.numel())
            if cur and size[g] + n > cap:
                closed.append((g, cur))
                cur = open_[g] = []
            if not cur:
                size[g] = 0
            cur.append(s)
            size[g] += n
        closed.extend((g, cur) for g, cur in open_.items() if cur)
        # Bucket 0 holds the last parameters: the order backward completes them in.
        closed.sort(key=lambda gc: -max(t.index for t in gc[1]))
        return [Bucket(i, g[0], slots) for i, (g, slots) in enumerate(closed)]

    def _allocate(self, b):
        device = b.slots[0].param.device
        total, off = 0, []
        for s in b.slots:
            if s.param.device != device:
                raise ValueError(f"parameters of one bucket on {device} and {s.param.device}")
            off.append(total)
            total += _aligned(s.param.numel())
        total = max(total, _ALIGN_FLOATS)  # a registered tensor may not be empty
        b.weights = torch.zeros(total, dtype=torch.float32, device=device)
        b.grads = torch.zeros(total, dtype=torch.float32, device=device)
        with torch.no_grad():
            for s, o in zip(b.slots, off):
                p, n = s.param, s.param.numel()
                s.bucket, s.offset, s.numel = b, o, n
                w = b.weights[o:o + n].view(p.shape)
                w.copy_(p.detach())
                g = b.grads[o:o + n].view(p.shape)
                if p.grad is not None:
                    g.copy_(p.grad)
                s.grad_view = g
                p.data = w   # the parameter now lives in the bucket (same Parameter object)
                p.grad = g

    # ---- what the optimizer uses ----

    def names_of_group(self, i):
        """The registered tensor names (buckets) holding parameter group i."""
        return [b.name for b in self.buckets if b.group == i]

    @property
    def names(self):
        return [b.name for b in self.buckets]

    def bucket_of(self, param):
        return self._slot_of[id(param)].bucket

    def register(self):
        """Registers every bucket (one tensor each) with the client; before client.start().
        Every worker must build the same buckets (same model, groups and bucket_bytes)."""
        for b in self.buckets:
            self.client.register(b.name, b.weights, b.grads)
        self._registered = True

    def install(self, module=None):
        """Installs the gradient hooks and, given the model, a forward pre-hook on each of its
        modules (without a model, finish_step waits for the pulls). After client.start()."""
        with torch.enable_grad():
            for s in self._slots:
                p = s.param
                if not p.requires_grad:
                    continue
                if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda _p, s=s: self._on_grad(s)))
                else:
                    acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    self._grad_accs.append(acc)
                    self._hooks.append(acc.register_hook(lambda *_, s=s: self._on_grad(s)))
        if module is not None:
            # Every module gets a pre-hook (one without parameters may be the nearest ancestor
            # that runs, below); each first waits for the buckets of its own parameters.
            self._parent = {}
            for name, m in module.named_modules():
                for _, child in m.named_children():
                    self._parent.setdefault(id(child), m)
                own = []
                for p in m.parameters(recurse=False):
                    s = self._slot_of.get(id(p))
                    if s is not None and s.bucket not in own:
                        own.append(s.bucket)
                self._waits[id(m)] = own
                self._modules[id(m)] = m
                self._hooks.append(m.register_forward_pre_hook(
                    lambda _m, _inp, k=id(m): self._before_forward(k)))
            self._recording = True
            self._ran = set()
            self._modules_hooked = True

    def close(self):
        """Waits for what is in flight and removes the hooks (the buffers stay the model's)."""
        self.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks, self._grad_accs = [], []

    def zero_grad(self):
        """Zeroes the gradient buffers in place (one fill per bucket) and puts back any .grad
        that was replaced or set to None."""
        for b in self.buckets:
            if b.push is not None:
                raise RuntimeError(f"zero_grad while the push of {b.name} is in flight")
            b.grads.zero_()
        for s in self._slots:
            if s.param.grad is not s.grad_view:
                s.param.grad = s.grad_view

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside accumulate without pushing."""
        old, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = old

    def finish_step(self):
        """Pushes the buckets backward did not complete, clocks, issues every pull (forward
        order) and waits for this step's pushes. Pulls are awaited by the forward pre-hooks,
        or here (lazy_pulls False, or no model installed)."""
        if not self._registered:
            raise RuntimeError("finish_step before register()")
        self._check_storage()
        if self._recording and self._ran:
            self._learn_waits()
        if self._seen_order:  # the order the last forward needed the buckets in
            seen = set(id(b) for b in self._seen_order)
            self._pull_order = self._seen_order + [b for b in self._pull_order
                                                   if id(b) not in seen]
            self._seen_order = []
        for b in self._pull_order:  # forward order: the first layers' buckets first
            if not b.pushed:
                # No parameter of the bucket has a gradient: each is frozen, or backward did not
                # reach it and its .grad is None (model.zero_grad() set it so; zero_grad() of
                # the optimizer keeps the zeroed buffers, which then count as zero gradients,
                # as torch's set_to_none=False does).
                none = all(not s.param.requires_grad or (not s.ready and s.param.grad is None)
                           for s in b.slots)
                for s in b.slots:
                    self._adopt_grad(s, zero_if_none=True)
                self._push(b, no_grad=none)
        if self.step_pushes:
            if not self._prepared:  # no bucket was pushed this step: the rules go first
                self._prepared = True
                if self._before_push is not None:
                    self._before_push()
            self._step_handles = [self.client.push(n) for n in self.step_pushes]
        self.client.clock()
        for b in self._pull_order:
            b.pull = self.client.pull(b.name)
        for b in self.buckets:
            self.client.wait(b.push)
            b.push = None
            b.pushed = False
            b.ready = 0
        handles, self._step_handles = self._step_handles, []
        for h in handles:
            self.client.wait(h)
        for s in self._slots:
            s.ready = False
        self._prepared = False
        if not self.lazy_pulls or not self._modules_hooked:
            self.synchronize()

    def synchronize(self):
        """Waits for every pull and push in flight: after it the parameters hold the pulled
        weights (call it before reading them outside the model's forward)."""
        for b in self._pull_order:
            if b.pull is not None:
                h, b.pull = b.pull, None
                self.client.wait(h)
        for b in self.buckets:
            if b.push is not None:
                h, b.push = b.push, None
                self.client.wait(h)
        handles, self._step_handles = self._step_handles, []
        for h in handles:
            self.client.wait(h)

    def pending_pulls(self):
        """Names of the buckets whose pull is still in flight."""
        return [b.name for b in self.buckets if b.pull is not None]

    # ---- hooks ----

    def _learn_waits(self):
        """After the first forward: a module that owns parameters but did not run (its
        parent used its parameters directly, as nn.MultiheadAttention does with out_proj)
        has its buckets awaited by its nearest ancestor that ran."""
        self._recording = False
        for k, own in list(self._waits.items()):
            if k in self._ran or not own:
                continue
            a = self._parent.get(k)
            while a is not None and id(a) not in self._ran:
                a = self._parent.get(id(a))
            if a is not None:
                waits = self._waits[id(a)]
                waits.extend(b for b in own if b not in waits)
                log.info("shardps overlap: parameters of module %s (not called by the "
                         "forward) are awaited before module %s",
                         type(self._modules[k]).__name__, type(a).__name__)

    def _before_forward(self, key):
        if self._recording:
            # Until the modules that run are known, the first module to run waits for all
            # (usually none is in flight: start() pulled synchronously).
            self._ran.add(key)
            self.synchronize()
            return
        for b in self._waits.get(key, ()):
            if b.pull is not None:
                h, b.pull = b.pull, None
                self.client.wait(h)
                self._seen_order.append(b)

    def _on_grad(self, s):
        b = s.bucket
        if b.pull is not None:
            raise RuntimeError(
                f"shardps overlap: gradient of '{s.name}' computed while the pull of its bucket "
                f"{b.name} was in flight: the forward read weights the network was writing (use "
                f"parameters inside the forward of a module that owns them, or call "
                f"synchronize() before the forward)")
        if not self._sync_grads:
            return
        if b.pushed:
            raise RuntimeError(
                f"shardps overlap: gradient of '{s.name}' accumulated after its bucket {b.name} "
                f"was pushed this step (a second backward before step(): wrap all but the last "
                f"micro-batch in no_sync())")
        if s.ready:
            return
        self._adopt_grad(s, zero_if_none=False)
        s.ready = True
        b.ready += 1
        if b.ready == b.trainable:
            self._push(b)

    def _check_storage(self):
        """Parameters are views of their bucket; one whose storage changed since
        (model.to(), .cuda(), .half() after the optimizer was built) would no longer see the
        pulls. Refuse the step instead of training the bucket alone."""
        for b in self.buckets:
            if getattr(b, "weights", None) is None:
                continue  # not allocated yet
            base = b.weights.data_ptr()
            for s in b.slots:
                if s.param.data_ptr() != base + 4 * s.offset:
                    raise RuntimeError(
                        f"shardps: parameter '{s.name}' was moved or replaced after "
                        f"DistributedOptimizer(overlap=True) put it in its bucket (now "
                        f"on {s.param.device}, {s.param.dtype}): build the optimizer after "
                        "model.to(device) / .half(), or re-create it")

    def _adopt_grad(self, s, zero_if_none):
        """Makes s.param.grad the bucket view again (copying a replaced gradient into it)."""
        p = s.param
        if p.grad is s.grad_view:
            return
        with torch.no_grad():
            if p.grad is None:
                if zero_if_none:
                    s.grad_view.zero_()
            elif p.grad.data_ptr() != s.grad_view.data_ptr():
                if not self._warned_replaced:
                    log.warning("shardps: .grad of '%s' was replaced; copying it into its "
                                "bucket (zero gradients with zero_grad() of the optimizer)",
                                s.name)
                    self._warned_replaced = True
                s.grad_view.copy_(p.grad)
        p.grad = s.grad_view

    def _push(self, b, no_grad=False):
        if not self._prepared:
            self._prepared = True
            if self._before_push is not None:
                self._before_push()
        if b.pull is not None:  # its parameters were not used by the forward
            h, b.pull = b.pull, None
            self.client.wait(h)
        if b.weights.is_cuda:
            torch.cuda.current_stream().synchronize()
        # No parameter of the bucket has a gradient this step (finish_step decides): the push
        # carries the mark, and a clock where every worker's does leaves the bucket as it is
        # (weights and optimizer state), as torch skips parameters without a .grad.
        if b.no_grad_sent != no_grad:
            self.client.set_no_gradient(b.name, no_grad)
            b.no_grad_sent = no_grad
        b.push = self.client.push(b.name)
        b.pushed = True


def _aligned(n):
    return (n + _ALIGN_FLOATS - 1) // _ALIGN_FLOATS * _ALIGN_FLOATS
