"""PyTorch integration: DistributedOptimizer, the parameter servers as the optimizer.

Each step pushes every parameter's gradient into the servers' memory, advances the clock and
pulls the new weights straight into the parameters (zero-copy: the parameters' and gradients'
own storage is registered). The servers apply the update rule (their --optimizer and --lr).

    opt = shardps.torch.DistributedOptimizer(model, coordinator="10.0.0.1:7070",
                                             cluster_token=token, consistency="bsp")
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

Consistency is a property of the cluster (the coordinator's --consistency / --staleness, every
worker obeys the same bound). `consistency=` selects what this trainer requires: "bsp", "ssp",
"asp" or "vsgd" (with `staleness=` for ssp/vsgd); a cluster running another mode is an error
at construction, never a silent difference. shardps.launch.LocalCluster(consistency=...) and
scripts/mpirun.sh --consistency start a cluster in the mode you select.

Thread safety: one training thread, like shardps.Client.
"""
import logging
import math
import re

import torch

from . import Client, Error  # noqa: F401

log = logging.getLogger("shardps")

MODES = ("bsp", "ssp", "asp", "vsgd")


def parse_consistency(text):
    """'ssp(s=2)' -> ('ssp', 2); 'bsp' -> ('bsp', 0)."""
    m = re.fullmatch(r"([a-z]+)(?:\(s=(\d+)\))?", text.strip())
    if not m:
        raise ValueError(f"unrecognised consistency '{text}'")
    return m.group(1), int(m.group(2) or 0)


# torch.optim classes the servers apply, exactly (server/optimizer.h), and their group keys.
_RULES = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}


def _rule_of(kind, group):
    """The wire rule of one param group: (kind, lr, momentum, dampening, nesterov, wd, b1, b2,
    eps), refusing what the servers do not apply rather than training something else."""
    if kind == "server":
        return ("server", float(group["lr"]), 0.0, 0.0, False, 0.0, 0.9, 0.999, 1e-8)
    for key in ("maximize", "amsgrad", "differentiable", "capturable"):
        if group.get(key):
            raise ValueError(f"shardps: {key}=True is not applied by the servers (supported: "
                             "SGD with momentum/dampening/nesterov/weight_decay, Adam and AdamW "
                             "with betas/eps/weight_decay)")
    lr = float(group["lr"])
    if kind == "sgd":
        return ("sgd", lr, float(group.get("momentum", 0.0)), float(group.get("dampening", 0.0)),
                bool(group.get("nesterov", False)), float(group.get("weight_decay", 0.0)),
                0.9, 0.999, 1e-8)
    b1, b2 = group.get("betas", (0.9, 0.999))
    return (kind, lr, 0.0, 0.0, False, float(group.get("weight_decay", 0.0)), float(b1),
            float(b2), float(group.get("eps", 1e-8)))


_NONFINITE = "shardps.nonfinite_workers"

# ---- Row tables: embeddings whose rows live on the servers (docs/embeddings.md) ------------

_TABLE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_TABLE_RULES = ("server", "sgd", "adagrad", "adam")
# A table's optimizer state rows in DistributedOptimizer.state_dict(), under torch's names.
_TABLE_STATE_KEYS = {"adagrad": ("sum", None), "adam": ("exp_avg", "exp_avg_sq")}


class _PullRows(torch.autograd.Function):
    """forward: the table's rows `uniq` (pulled, one-sided); backward: their gradient is added
    to the table's gradient of this step (pushed by the optimizer's step())."""

    @staticmethod
    def forward(ctx, anchor, table, uniq):
        rows = torch.empty(len(uniq), table.embedding_dim, dtype=table.dtype)
        table._client.pull_rows(table.table_name, uniq, rows)
        ctx.table, ctx.uniq = table, uniq
        return rows

    @staticmethod
    def backward(ctx, grad):
        g = grad.detach().to(device="cpu", dtype=ctx.table.dtype).contiguous()
        ctx.table._client.add_row_grads(ctx.table.table_name, ctx.uniq, g)
        return None, None, None


class _RowTable(torch.nn.Module):
    def __init__(self, num_embeddings, embedding_dim, *, name=None, dtype=torch.float32,
                 max_ids=16384, init="normal", init_scale=1.0, init_seed=0, optimizer="server",
                 lr=0.0, eps=None, betas=(0.9, 0.999), lr_decay=0.0,
                 initial_accumulator_value=0.0, hashed=False, admit_probability=1.0,
                 cache_rows=0):
        super().__init__()
        if dtype not in _TABLE_DTYPES:
            raise TypeError(f"a row table is float32, float16 or bfloat16, not {dtype}")
        if optimizer not in _TABLE_RULES:
            raise ValueError(f"a row table's optimizer is one of {_TABLE_RULES} (torch's sparse "
                             f"rules: SGD, Adagrad, SparseAdam), not '{optimizer}'")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.table_name, self.dtype, self.max_ids = name, dtype, int(max_ids)
        self.init, self.init_scale, self.init_seed = init, float(init_scale), int(init_seed)
        self.optimizer, self.lr, self.betas = optimizer, float(lr), tuple(betas)
        self.eps = (1e-10 if optimizer == "adagrad" else 1e-8) if eps is None else float(eps)
        self.lr_decay = float(lr_decay)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.hashed, self.admit_probability = bool(hashed), float(admit_probability)
        self.cache_rows = int(cache_rows)
        self._client = None
        self._started = False
        self._pending = None  # a load_state_dict before the client started: (keys, weight)
        self._sent = None
        # Makes the pulled rows part of the autograd graph (the table has no torch parameter).
        self._anchor = torch.zeros(0, requires_grad=True)

    def attach(self, client, name=None):
        """Registers the table with a client that has not started (DistributedOptimizer does
        this for the tables of its model)."""
        if name is not None and self.table_name is None:
            self.table_name = name
        if self.table_name is None:
            raise ValueError("a row table needs a name")
        client.register_embedding(self.table_name, self.num_embeddings, self.embedding_dim,
                                  dtype=_TABLE_DTYPES[self.dtype], max_ids=self.max_ids,
                                  init=self.init, init_scale=self.init_scale,
                                  init_seed=self.init_seed, hashed=self.hashed,
                                  admit_probability=self.admit_probability,
                                  cache_rows=self.cache_rows)
        self._client = client

    def started(self):
        """DistributedOptimizer, after the client started: a table loaded before is set now
        (load_state_dict), by every worker that loaded it."""
        self._started = True
        if self._pending is not None:
            keys, weight = self._pending
            self._pending = None
            self._set_rows(keys, weight)

    # ---- state_dict / load_state_dict: the rows (the optimizer state: DistributedOptimizer's) --
    # torch's own keys: "weight" (num_embeddings x dim, the table's dtype) for dense ids; a
    # hashed table also "keys" (int64: the keys holding a row, with "weight" their rows).
    _BATCH = 1 << 16  # rows per get / set call

    def _all_ids(self):
        if self.hashed:
            return torch.from_numpy(self._client.table_keys(self.table_name)).sort().values
        return torch.arange(self.num_embeddings, dtype=torch.int64)

    def _get_rows(self, ids, state=False):
        """float32 rows `ids` (and their optimizer state rows): (weight, s1, s2, steps,
        has1, has2)."""
        n, d = len(ids), self.embedding_dim
        w = torch.empty(n, d)
        s1 = torch.empty(n, d) if state else None
        s2 = torch.empty(n, d) if state else None
        steps, has1, has2 = 0, False, False
        for a in range(0, n, self._BATCH):
            b = min(n, a + self._BATCH)
            st, h1, h2 = self._client.get_rows(
                self.table_name, ids[a:b].contiguous(), w[a:b],
                None if s1 is None else s1[a:b], None if s2 is None else s2[a:b])
            steps, has1, has2 = max(steps, st), has1 or h1, has2 or h2
        return w, s1, s2, steps, has1, has2

    def _set_rows(self, ids, values, part="weights", steps=0):
        values = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
        for a in range(0, len(ids), self._BATCH):
            b = min(len(ids), a + self._BATCH)
            self._client.set_rows(self.table_name, part, ids[a:b].contiguous(), values[a:b], steps)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._started:
            ids = self._all_ids()
            weight = self._get_rows(ids)[0].to(self.dtype)
        elif self._pending is not None:
            ids, weight = self._pending
            weight = weight.to(self.dtype)
        elif self.hashed:
            ids = torch.zeros(0, dtype=torch.int64)
            weight = torch.zeros(0, self.embedding_dim, dtype=self.dtype)
        else:
            # Not started yet: the rows the servers will start from (shardps.row_init).
            from . import row_init
            ids = None
            all_ids = torch.arange(self.num_embeddings, dtype=torch.int64).numpy()
            weight = torch.from_numpy(row_init(self.init, self.init_scale, self.init_seed,
                                               all_ids, self.embedding_dim)).to(self.dtype)
        destination[prefix + "weight"] = weight
        if self.hashed:
            destination[prefix + "keys"] = ids

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        wkey, kkey = prefix + "weight", prefix + "keys"
        if strict:
            mine = (wkey, kkey) if self.hashed else (wkey,)
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and
                                   "." not in k[len(prefix):] and k not in mine)
        if wkey not in state_dict or (self.hashed and kkey not in state_dict):
            missing_keys.extend(k for k in ([wkey, kkey] if self.hashed else [wkey])
                                if k not in state_dict)
            return
        weight = state_dict[wkey]
        if self.hashed:
            keys = torch.as_tensor(state_dict[kkey], dtype=torch.int64).reshape(-1)
            want = (len(keys), self.embedding_dim)
        else:
            keys = torch.arange(self.num_embeddings, dtype=torch.int64)
            want = (self.num_embeddings, self.embedding_dim)
        if tuple(weight.shape) != want:
            error_msgs.append(f"size mismatch for {wkey}: copying a param with shape "
                              f"{tuple(weight.shape)}, the shape in the current model is "
                              f"{want} (row table '{self.table_name}')")
            return
        if self.hashed and len(keys) > self.num_embeddings:
            error_msgs.append(f"{kkey}: {len(keys)} keys exceed row table "
                              f"'{self.table_name}''s capacity {self.num_embeddings}")
            return
        if self._started:
            self._set_rows(keys, weight)
        else:
            self._pending = (keys, weight.detach().to("cpu", torch.float32).clone())

    def rule(self):
        """The wire rule: (kind, lr, momentum, dampening, nesterov, wd, b1, b2, eps, lr_decay,
        initial_accumulator_value)."""
        return (self.optimizer, self.lr, 0.0, 0.0, False, 0.0, float(self.betas[0]),
                float(self.betas[1]), self.eps, self.lr_decay, self.initial_accumulator_value)

    def send_rule(self):
        r = self.rule()
        if r != self._sent:
            self._client.set_rule(self.table_name, *r[:9], lr_decay=r[9],
                                  initial_accumulator_value=r[10])
            self._sent = r

    def _rows(self, ids):
        if self._client is None:
            raise RuntimeError(f"row table '{self.table_name}' is not attached to a client "
                               "(build DistributedOptimizer over the model first)")
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        rows = _PullRows.apply(self._anchor, self, uniq.contiguous())
        if ids.is_cuda:
            rows = rows.to(ids.device)
            inverse = inverse.to(ids.device)
        return rows, inverse

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, name={self.table_name!r}, "
                f"optimizer={self.optimizer!r}, lr={self.lr}")


class Embedding(_RowTable):
    """torch.nn.Embedding whose table lives on the parameter servers, sharded by row id.

    forward(ids) reads only the distinct rows of the batch (one-sided reads, at the cluster's
    consistency bound); backward adds their gradient rows to this step's sparse gradient, which
    DistributedOptimizer.step() pushes (one push per shard). The servers apply the table's own
    sparse rule (`optimizer`: "sgd", "adagrad", "adam" (lazy, as torch.optim.SparseAdam) or
    "server"), with `lr` (0: the servers' --lr) and its hyper-parameters; set `.lr` for a
    schedule. Rows start from `init` ("normal" N(0, init_scale^2) as torch's, "uniform",
    "zeros"), computed by the servers from (init_seed, row id): shardps.row_init gives the same
    values. max_ids bounds the distinct rows of one step per shard. hashed=True takes any int64
    id (a feature hash): num_embeddings is then the capacity, rows are created on first touch
    (with probability admit_probability) and a full bucket evicts its least recently updated
    row (docs/embeddings.md). cache_rows > 0 keeps that many rows read in a worker-side cache,
    served while they meet the consistency bound (SSP/ASP; counters() reports hits).
    """

    def forward(self, ids):
        rows, inverse = self._rows(ids)
        return torch.nn.functional.embedding(inverse, rows).reshape(*ids.shape,
                                                                    self.embedding_dim)


class EmbeddingBag(_RowTable):
    """torch.nn.EmbeddingBag over a row table (see Embedding): mode "sum", "mean" or "max";
    input 2-D (bags of equal length) or 1-D with offsets; per_sample_weights with "sum"."""

    def __init__(self, num_embeddings, embedding_dim, mode="mean", **kwargs):
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.mode = mode

    def forward(self, input, offsets=None, per_sample_weights=None):
        rows, inverse = self._rows(input)
        inverse = inverse.reshape(input.shape)
        return torch.nn.functional.embedding_bag(inverse, rows, offsets, mode=self.mode,
                                                 per_sample_weights=per_sample_weights)


class DistributedOptimizer(torch.optim.Optimizer):
    """Pushes gradients and pulls parameters through a shardps.Client every step().

    Two forms:

        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model)          # wrap a torch optimizer (SGD, Adam, AdamW)
        opt = DistributedOptimizer(model, lr=0.1)  # the servers' own --optimizer, this rate

    Wrapping: the servers apply the wrapped optimizer's rule to each param group, with its own
    lr, momentum, dampening, nesterov, weight_decay, betas and eps, with torch.optim's exact
    semantics, keeping the optimizer state (momentum buffers, Adam moments) per chunk. This
    optimizer shares the wrapped one's param_groups, so a scheduler attached to either (StepLR,
    OneCycleLR with cycle_momentum, CosineAnnealingLR, ...) changes what the servers apply from
    the next step: the rule travels in the push headers, no control message per step.
    Unsupported options (maximize, amsgrad, other optimizer classes) are refused here.

    The other form: the update rule is the servers' --optimizer; each group's "lr" is the rate
    they apply (lr=None keeps the servers' --lr; a schedule then has nothing to scale).
    `param_groups`: optional list of {"params": [tensors of the model], "lr": x}, as for
    torch.optim; parameters in no group form a group with the default lr.

    state_dict() holds the param groups (the optimizer state lives on the servers, see
    docs/python.md).
    """

    def __init__(self, model_or_named_params, model=None, *, client=None, lr=None,
                 param_groups=None,
                 consistency=None, staleness=0, coordinator=None, cluster_token="",
                 named_parameters=None, wire_dtype=None, check_finite=False, overlap=False,
                 bucket_bytes=1 << 20, **client_kwargs):
        inner = None
        if isinstance(model, Client):  # the older positional form (model, client)
            model, client = None, model
        if isinstance(model_or_named_params, torch.optim.Optimizer):
            # Horovod's form: DistributedOptimizer(optimizer, model) or named_parameters=.
            inner = model_or_named_params
            if type(inner) not in _RULES:
                names = ", ".join(c.__name__ for c in _RULES)
                raise TypeError(f"shardps: the servers apply {names}; not "
                                f"{type(inner).__name__}")
            src = model if named_parameters is None else named_parameters
            if src is None:
                raise ValueError("shardps: wrapping an optimizer needs the model (or "
                                 "named_parameters=) for the parameters' names")
            model_or_named_params = src
            if lr is not None or param_groups is not None:
                raise ValueError("lr= and param_groups= come from the wrapped optimizer")
        elif model is not None:
            raise TypeError("the second argument is the model, for a wrapped torch optimizer")
        if isinstance(model_or_named_params, torch.nn.Module):
            named = list(model_or_named_params.named_parameters())
        else:
            named = list(model_or_named_params)
        if not named:
            raise ValueError("no parameters to train")
        name_of = {id(p): n for n, p in named}
        if isinstance(model_or_named_params, torch.nn.Module):
            # torch's sparse embeddings train here, but as dense tensors: their whole table is
            # pushed and pulled every step. Say so, and what to use instead.
            for mname, m in model_or_named_params.named_modules():
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
                    log.warning("shardps: %s '%s' (%d x %d, sparse=True) is trained as a dense "
                                "tensor: its whole table is pushed and pulled every step. Use "
                                "shardps.torch.%s for a row table (only the rows a batch "
                                "touches move; docs/embeddings.md)", type(m).__name__, mname,
                                m.num_embeddings, m.embedding_dim, type(m).__name__)
        if inner is not None:
            trained = {id(p) for g in inner.param_groups for p in g["params"]}
            missing = [n for n, p in named if id(p) not in trained]
            if any(id(p) not in name_of for g in inner.param_groups for p in g["params"]):
                raise ValueError("the wrapped optimizer holds a tensor that is not a parameter "
                                 "of the model")
            named = [(n, p) for n, p in named if id(p) in trained]
            if missing:
                log.info("shardps: %d parameter(s) not in the optimizer are not trained: %s",
                         len(missing), ", ".join(missing[:5]))
            super().__init__([{"params": list(g["params"])} for g in inner.param_groups],
                             dict(inner.defaults))
            # The same group dicts: a scheduler on either optimizer drives both.
            self.param_groups = inner.param_groups
            self._kind = _RULES[type(inner)]
        else:
            groups, grouped = [], set()
            for g in param_groups or []:
                g = dict(g)
                ps = list(g["params"])
                for p in ps:
                    if id(p) not in name_of:
                        raise ValueError("a param group names a tensor that is not a parameter "
                                         "of the model")
                    grouped.add(id(p))
                g["params"] = ps
                groups.append(g)
            rest = [p for _, p in named if id(p) not in grouped]
            if rest:
                groups.append({"params": rest})
            super().__init__(groups, {"lr": 0.0 if lr is None else float(lr)})
            self._kind = "server"
        self.wrapped = inner
        self._name_of = name_of
        self._sent_rule = {}
        for g in self.param_groups:
            _rule_of(self._kind, g)  # refuse unsupported options before connecting
        if client is None:
            # No coordinator given: the client takes it (and the token, rank, transport) from
            # the environment a launcher set (SHARDPS_COORDINATOR ...; python -m shardps.run).
            client = Client(coordinator or "", cluster_token=cluster_token, **client_kwargs)
        if wire_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError("wire_dtype must be None, torch.float16 or torch.bfloat16")
        if overlap and (wire_dtype is not None or check_finite):
            raise ValueError("overlap=True pushes during backward, before a step could be "
                             "checked for non-finite gradients or cast: it takes float32 "
                             "parameters without wire_dtype or check_finite")
        self.client = client
        self._params = []
        self._storage = {}  # name -> (data_ptr, device) of the parameter when registered
        self._no_grad_sent = {}  # name -> the client's SetNoGradient mark
        self._shadows = []  # (p, g, w16, g16): float32 parameters sent as wire_dtype
        self._sync = None
        if overlap:
            from .overlap import BucketedSync
            self._sync = BucketedSync(client, named,
                                      groups=[g["params"] for g in self.param_groups],
                                      bucket_bytes=bucket_bytes, before_push=self._send_lr)
            self._sync.register()
            named = []  # registered as buckets
        for name, p in named:
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(f"parameter '{name}' is {p.dtype}; ShardPS trains float32, "
                                "float16 and bfloat16 tensors")
            if not p.is_contiguous():
                raise ValueError(f"parameter '{name}' is not contiguous")
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if wire_dtype is not None and p.dtype == torch.float32:
                # AMP (autocast, GradScaler) keeps float32 parameters: they travel as 16-bit
                # copies, cast once per step each way (the only copies on this path).
                w16 = p.detach().to(wire_dtype)
                g16 = torch.zeros_like(w16)
                client.register(name, w16, g16)
                self._shadows.append((p, p.grad, w16, g16))
            else:
                # p.detach() shares p's storage: the pulls write the parameter itself.
                client.register(name, p.detach(), p.grad)
            self._params.append((name, p, p.grad))
            self._storage[name] = (p.data_ptr(), p.device)
            log.info("shardps: '%s' %s %s on %s: path %s", name, tuple(p.shape),
                     wire_dtype if self._shadows and self._shadows[-1][0] is p else p.dtype,
                     p.device, client.tensor_path(name))
        # How many workers' gradients were not all finite at each step (a kStore tensor: the
        # clock's pushes summed), so that every worker's GradScaler backs off alike.
        self._inf_w = torch.zeros(1)
        self._inf_g = torch.zeros(1)
        if self._sync is None:
            client.register(_NONFINITE, self._inf_w, self._inf_g)
        self._check_finite = check_finite
        self._rows_unscaled = False  # this step's rows divided by a GradScaler's scale already
        self._rows_finite = True
        self.skipped = False  # whether the last step was skipped (a worker's non-finite grads)
        self._cuda = any(p.is_cuda for _, p, _ in self._params)
        # Row tables of the model: registered (after the dense tensors, in module order, the
        # same on every worker) and attached to this client.
        self._tables = []
        if isinstance(model_or_named_params, torch.nn.Module):
            for mname, m in model_or_named_params.named_modules():
                if isinstance(m, _RowTable):
                    m.attach(client, m.table_name or mname or "embedding")
                    self._tables.append(m)
        if self._sync is not None:
            # Overlapped: the dense buckets go during backward; the tables' sparse gradients,
            # complete only when backward is, go at step(), before the clock.
            self._sync.step_pushes = [m.table_name for m in self._tables]
        client.start()  # rank 0's weights become every worker's
        for m in self._tables:
            m.send_rule()
            m.started()  # a table loaded before now is set (by each worker that loaded it)
        if self._sync is None:
            client.set_rule(_NONFINITE, "store", 0.0)
        else:
            # Gradient hooks, and a forward pre-hook per module that awaits its pull (named
            # parameters only: the pulls are awaited at the end of step()).
            self._sync.install(model_or_named_params
                               if isinstance(model_or_named_params, torch.nn.Module) else None)
        if consistency is not None:
            mode, s = parse_consistency(client.consistency)
            want = consistency.lower()
            if want not in MODES:
                raise ValueError(f"consistency must be one of {MODES}, not '{consistency}'")
            if mode != want or (want in ("ssp", "vsgd") and s != staleness):
                raise Error(f"FAILED_PRECONDITION: this trainer requires {want}"
                            f"{'(s=%d)' % staleness if want in ('ssp', 'vsgd') else ''} but the "
                            f"cluster runs {client.consistency} (set the coordinator's "
                            "--consistency/--staleness)")
        self._warned = False

    @property
    def rank(self):
        return self.client.rank

    @property
    def num_workers(self):
        return self.client.num_workers

    def no_sync(self):
        """overlap=True: backward passes inside `with opt.no_sync():` accumulate without
        pushing (gradient accumulation); without overlap nothing is pushed before step()."""
        import contextlib
        return self._sync.no_sync() if self._sync is not None else contextlib.nullcontext()

    def barrier(self, timeout=0.0):
        """Waits until every live worker has called barrier() as often as this one
        (Client::Barrier; ps-lite's Barrier, torch.distributed.barrier without a process
        group). Under SSP and ASP call it after every worker's load_state_dict(), before
        training on, so that no worker reads or updates what another one's load then
        overwrites. timeout in seconds (0: the setup timeout)."""
        self.synchronize()
        self.client.barrier(timeout)

    def synchronize(self):
        """overlap=True: waits for the pulls in flight (the parameters hold the new weights
        after it; forward pre-hooks do this per layer). Without overlap: nothing to wait for."""
        if self._sync is not None:
            self._sync.synchronize()

    def zero_grad(self, set_to_none=True):
        """Zeroes the registered gradient buffers in place, and drops the row tables' gradient
        rows not yet pushed (a batch a trainer abandoned, say for a non-finite loss, must not
        reach the next step through its rows). set_to_none is accepted and not honoured: the
        registered memory must stay the gradient (zeros push the same as none)."""
        for m in self._tables:
            self.client.clear_row_grads(m.table_name)
        self._rows_unscaled = False
        if self._sync is not None:
            self._sync.zero_grad()
            return
        for _, p, g in self._params:
            g.zero_()
            if p.grad is not g:
                p.grad = g

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        grad_scaler=None):
        """torch.nn.utils.clip_grad_norm_ over this step's whole gradient: the dense
        parameters' .grad and the row tables' gradient rows, which live in the client and which
        torch's function does not see. Returns the total 2-norm (before clipping), as torch's.
        Under AMP pass the GradScaler: the dense gradients are unscaled as by
        grad_scaler.unscale_(opt) (if the trainer has not called it) and the rows alike; then
        opt.step(grad_scaler=...) or scaler.step(opt) as usual. Before step(), without
        overlap (overlap=True pushed the dense gradients during backward)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: only the 2-norm is supported, not {norm_type}")
        if self._sync is not None:
            raise RuntimeError("overlap=True pushed the gradients during backward, before they "
                               "could be clipped: use overlap=False to clip")
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._unscale_with(grad_scaler)
        grads = [p.grad for _, p, _ in self._params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        sq = sum((float(g.detach().double().pow(2).sum()) for g in grads), 0.0)
        sq += sum(self.client.row_grads_squared_norm(m.table_name) for m in self._tables)
        total = math.sqrt(sq) if sq >= 0 else float("nan")
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"clip_grad_norm_: the total norm of the gradients is {total}")
        coef = float(max_norm) / (total + 1e-6)
        if not coef < 1.0 and math.isfinite(total):
            return torch.tensor(total, device=device)
        # An inf or nan total scales by 0 or nan, as torch does: inf * 0 is nan, still seen.
        for g in grads:
            g.mul_(coef)
        for m in self._tables:
            self.client.scale_row_grads(m.table_name, coef)
        return torch.tensor(total, device=device)

    def _unscale_with(self, grad_scaler):
        """Divides this step's gradients by the scaler's scale, the dense ones once (through
        the scaler, which records their infs) and the rows once (scale_row_grads)."""
        try:  # torch >= 2.3 (torch.cuda.amp's is a deprecated alias there)
            from torch.amp.grad_scaler import OptState
        except ImportError:  # torch 1.13 (Debian 12)
            from torch.cuda.amp.grad_scaler import OptState
        state = grad_scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            # A new step's first unscale: whatever an abandoned step left does not count.
            self._rows_unscaled = False
            grad_scaler.unscale_(self)  # divides the gradients, finds infs and NaNs
        finite = True
        if not self._rows_unscaled:
            # Row tables' gradients are not in param_groups: unscale_ never saw them. They are
            # the scaled loss's too, added in backward: divide them by the same scale here.
            inv = float(grad_scaler._scale.double().reciprocal().float().item())
            finite = self._row_grads_finite(inv)
            self._rows_unscaled = True
        else:
            finite = self._row_grads_finite(1.0)
        self._rows_finite = finite
        return state

    def _check_storage(self):
        """A parameter whose storage changed since registration (model.to(), .cuda(), .half()
        or load_state_dict(assign=True) after the optimizer was built) would train its old
        storage silently: the pulls write there. Refuse the step instead."""
        for name, p, _ in self._params:
            ptr, device = self._storage[name]
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"shardps: parameter '{name}' was moved or replaced after "
                    f"DistributedOptimizer registered it (registered on {device}, now on "
                    f"{p.device}, {p.dtype}): build the optimizer after model.to(device) / "
                    ".half() / load_state_dict(assign=True), or re-create it")

    def _gather_grads(self):
        self._check_storage()
        for name, p, g in self._params:
            # A frozen parameter, or one without a .grad this step (model.zero_grad() sets None
            # and backward did not reach it): its push carries the no-gradient mark, and a clock
            # where every worker's does leaves it as it is (torch skips it: no weight decay, no
            # momentum, no Adam step).
            no_grad = p.grad is None or not p.requires_grad
            if self._no_grad_sent.get(name, False) != no_grad:
                self.client.set_no_gradient(name, no_grad)
                self._no_grad_sent[name] = no_grad
            if p.grad is None:  # no gradient this step: push zeros
                g.zero_()
                p.grad = g
            elif p.grad.data_ptr() != g.data_ptr():
                # Someone replaced .grad (e.g. zero_grad(set_to_none=True) on another optimizer):
                # copy into the registered buffer and put it back.
                if not self._warned:
                    log.warning("shardps: .grad of '%s' was replaced; copying it into the "
                                "registered buffer (use DistributedOptimizer.zero_grad)", name)
                    self._warned = True
                g.copy_(p.grad)
                p.grad = g

    # GradScaler calls step(grad_scaler=scaler) instead of deciding to skip by itself: the
    # decision must be every worker's, not this one's (docs/python.md, "Mixed precision").
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._sync is not None:
            if grad_scaler is not None:
                raise RuntimeError("overlap=True pushed the gradients during backward, before "
                                   "GradScaler could check them: use overlap=False with AMP")
            if self._cuda:
                torch.cuda.synchronize()
            self._sync.finish_step()  # the rest of the pushes, clock, pulls (awaited per layer)
            return loss
        self._gather_grads()
        self._send_lr()
        non_finite = False
        scaler_state = None
        if grad_scaler is not None:
            scaler_state = self._unscale_with(grad_scaler)
            non_finite = any(v.item() for v in scaler_state["found_inf_per_device"].values())
            non_finite |= not self._rows_finite
        elif self._check_finite:
            non_finite = not all(bool(torch.isfinite(g).all()) for _, _, g in self._params)
            non_finite |= not self._row_grads_finite(1.0)
        # BSP: a clock any worker marks is skipped on every server (server/optimizer.h).
        self.client.mark_non_finite(non_finite)
        self._inf_g.fill_(1.0 if non_finite else 0.0)
        for _, g, _, g16 in self._shadows:
            g16.copy_(g)
        if self._cuda:
            torch.cuda.synchronize()  # the gradients must be complete before they are copied
        self.client.step()
        # The next step's rows come scaled again. (A step that raised keeps the mark: a retry of
        # scaler.step(opt) must not divide the rows again; zero_grad() or the scaler's next
        # READY stage clears it.)
        self._rows_unscaled = False
        for p, _, w16, _ in self._shadows:
            p.copy_(w16)
        # The number of workers whose step was non-finite (BSP: this clock's).
        self.skipped = bool(self._inf_w.item() > 0)
        if scaler_state is not None:
            for v in scaler_state["found_inf_per_device"].values():
                v.fill_(1.0 if self.skipped else 0.0)  # every worker's scaler backs off alike
        return loss

    def _row_grads_finite(self, factor):
        """Multiplies every row table's gradient rows of this step by `factor`; whether all
        are finite then (an overflow skips the step as a dense one does)."""
        finite = True
        for m in self._tables:
            finite &= self.client.scale_row_grads(m.table_name, factor)
        return finite

    def _send_lr(self):
        for m in self._tables:
            m.send_rule()  # a table's lr may follow a schedule too
        # Each group's current rule (a scheduler may have changed its lr, momentum or betas)
        # goes with the next pushes of its parameters; only changes touch the client. With
        # overlap the tensors are the group's buckets, and this runs before a step's first push.
        for i, g in enumerate(self.param_groups):
            rule = _rule_of(self._kind, g)
            if rule[1] < 0:
                raise ValueError(f"negative learning rate {rule[1]}")
            names = (self._sync.names_of_group(i) if self._sync is not None
                     else [self._name_of.get(id(p)) for p in g["params"]])
            for name in names:
                if name is None or self._sent_rule.get(name) == rule:
                    continue
                if self._kind == "server":
                    self.client.set_lr(name, rule[1])
                else:
                    self.client.set_rule(name, *rule)
                self._sent_rule[name] = rule

    # ---- state_dict / load_state_dict: torch's own format, the servers' state -------------
    # The optimizer state lives on the servers (per chunk, float32); these move it, chunk by
    # chunk, through the data path (Client.get_state / set_state: pushes, acknowledged).
    # Keys are torch's: SGD "momentum_buffer"; Adam/AdamW "step", "exp_avg", "exp_avg_sq"
    # (the servers' own rule: "shardps_state1", "shardps_state2", "step"). The float32 master
    # weights travel too, under "shardps_master_weights" (plain torch ignores the key). Both are
    # set back in float32 whatever the tensor's dtype (a 16-bit tensor resumes bit for bit), as
    # row tables set theirs.

    def _units(self):
        """The registered tensors in torch's state_dict order: (tensor name, registered
        gradient buffer (flat view), [(state_dict index, parameter, offset, numel)]). A unit is
        a parameter, or with overlap=True a bucket of several."""
        index = {}
        i = 0
        for g in self.param_groups:
            for p in g["params"]:
                index[id(p)] = i
                i += 1
        if self._sync is not None:
            for b in self._sync.buckets:
                yield b.name, b.grads, [(index[id(t.param)], t.param, t.offset, t.numel)
                                        for t in b.slots if id(t.param) in index]
            return
        shadow = {id(p): g16 for p, _, _, g16 in self._shadows}
        for name, p, g in self._params:
            if id(p) in index:
                yield name, shadow.get(id(p), g).view(-1), [(index[id(p)], p, 0, p.numel())]

    def _state_keys(self):
        if self._kind == "sgd":
            return ("momentum_buffer", None)
        if self._kind in ("adam", "adamw"):
            return ("exp_avg", "exp_avg_sq")
        return ("shardps_state1", "shardps_state2")

    def state_dict(self):
        self.synchronize()
        sd = super().state_dict()
        k1, k2 = self._state_keys()
        state, master, master_state = {}, {}, {}
        for name, g, params in self._units():
            n = g.numel()
            w, s1, s2 = torch.empty(n), torch.empty(n), torch.empty(n)
            steps, has1, has2 = self.client.get_state(name, w, s1, s2)
            for i, p, off, cnt in params:
                master[i] = w[off:off + cnt].view(p.shape).clone()
                st = {}
                if has1:
                    st[k1] = s1[off:off + cnt].view(p.shape).to(p.dtype)
                if has2 and k2 is not None:
                    st[k2] = s2[off:off + cnt].view(p.shape).to(p.dtype)
                if self._kind != "sgd" and (steps or st):
                    st["step"] = torch.tensor(float(steps))
                if st:
                    state[i] = st
                if p.dtype != torch.float32 and (has1 or has2):
                    # torch keeps a 16-bit parameter's state in its dtype; the servers' float32
                    # state travels beside it, so that a load resumes bit for bit.
                    master_state[i] = {k: s[off:off + cnt].view(p.shape).clone()
                                       for k, s, has in ((k1, s1, has1), (k2, s2, has2))
                                       if has and k is not None}
        sd["state"] = state
        sd["shardps_master_weights"] = master
        if master_state:
            sd["shardps_master_state"] = master_state
        # Row tables (not torch parameters): their optimizer state rows, under torch's sparse
        # optimizers' names (Adagrad "sum"; SparseAdam "exp_avg", "exp_avg_sq"), and a hashed
        # table's keys. Their rows are the model's state_dict; a 16-bit table's float32 master
        # rows also travel here, under "shardps_master" (as a dense model's
        # "shardps_master_weights"), so that it resumes bit for bit.
        tables = {}
        for m in self._tables:
            ids = m._all_ids()
            w, s1, s2, steps, has1, has2 = m._get_rows(ids, state=True)
            k1, k2 = _TABLE_STATE_KEYS.get(m.optimizer, ("shardps_state1", "shardps_state2"))
            entry = {"step": int(steps)}
            if m.dtype in (torch.float16, torch.bfloat16):
                entry["shardps_master"] = w
            if has1:
                entry[k1] = s1
            if has2:
                entry[k2] = s2
            if m.hashed:
                entry["keys"] = ids
            tables[m.table_name] = entry
        if tables:
            sd["shardps_row_tables"] = tables
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Loads a torch-format optimizer state (from this class or a plain torch optimizer of
        the same kind) into the servers, with the weights: the master weights saved by
        state_dict(), else the model's current parameters (load the model first, as with
        torch). Every worker may call it; rank 0's values are the ones set."""
        self.synchronize()
        groups = self.param_groups
        super().load_state_dict(state_dict)
        for mine, loaded in zip(groups, self.param_groups):
            mine.update({k: v for k, v in loaded.items() if k != "params"})
        self.param_groups = groups  # still the wrapped optimizer's dicts
        self._sent_rule.clear()
        state = state_dict.get("state", {})
        master = state_dict.get("shardps_master_weights", {})
        master_state = state_dict.get("shardps_master_state", {})
        k1, k2 = self._state_keys()
        if self.rank == 0:
            for name, g, params in self._units():
                # One unit, one step count (its parameters were stepped together).
                sts = [state.get(i, {}) for i, _, _, _ in params]
                st0 = next((st for st in sts if st), {})
                steps = int(float(st0["step"])) if "step" in st0 else (1 if k1 in st0 else 0)

                # float32 values whatever the unit's dtype (Client::SetStateValues): a 16-bit
                # unit's float32 master and state load exactly; the gradient buffer is left
                # alone.
                values = torch.zeros(g.numel(), dtype=torch.float32)

                def send(part, value_of, n=0):
                    values.zero_()
                    for (i, p, off, cnt), st in zip(params, sts):
                        v = value_of(i, p, st)
                        if v is not None:
                            values[off:off + cnt].copy_(v.reshape(-1))
                    self.client.set_state(name, part, n, values=values)

                send("weights", lambda i, p, st: master.get(i, p.detach()))
                if not any(k1 in st for st in sts):
                    self.client.set_state(name, "none", steps)
                else:
                    def state_of(k):
                        # The float32 state saved beside a 16-bit parameter's, if it is there.
                        return lambda i, p, st: master_state.get(i, {}).get(k, st.get(k))

                    send("state1", state_of(k1), steps)
                    if k2 is not None and any(k2 in st for st in sts):
                        send("state2", state_of(k2), steps)
            for m in self._tables:
                entry = state_dict.get("shardps_row_tables", {}).get(m.table_name)
                if entry is None:
                    continue
                ids = (torch.as_tensor(entry["keys"], dtype=torch.int64) if m.hashed
                       else torch.arange(m.num_embeddings, dtype=torch.int64))
                k1, k2 = _TABLE_STATE_KEYS.get(m.optimizer, ("shardps_state1", "shardps_state2"))
                if "shardps_master" in entry:
                    # After the model's load (torch's order), which set the 16-bit rows.
                    m._set_rows(ids, entry["shardps_master"], "weights")
                for key, part in ((k1, "state1"), (k2, "state2")):
                    if key in entry:
                        m._set_rows(ids, entry[key], part, int(entry.get("step", 0)))
        self.state.clear()  # the servers hold it
        # Every worker pulls the weights at its next step; rank 0 already has them.

    def close(self):
        if self._sync is not None:
            self._sync.close()
        self.client.close()
