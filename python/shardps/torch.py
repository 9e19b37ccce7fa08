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


class DistributedOptimizer(torch.optim.Optimizer):
    """Pushes gradients and pulls parameters through a shardps.Client every step().

    A torch.optim.Optimizer: LR schedulers (StepLR, LambdaLR, OneCycleLR, ...) drive it, and each
    parameter group's "lr" is the rate the servers apply to that group's next pushes (it travels
    in the push headers: no control message per step). lr=None keeps the servers' --lr (a
    schedule then has nothing to scale). The update rule itself (sgd, momentum, adam and their
    other hyper-parameters) is the servers' --optimizer; state_dict() holds the param groups
    only (the optimizer state lives on the servers, see docs/python.md).

    `param_groups`: optional list of {"params": [tensors of the model], "lr": x}, as for
    torch.optim; parameters in no group form a group with the default lr.
    """

    def __init__(self, model_or_named_params, client=None, *, lr=None, param_groups=None,
                 consistency=None, staleness=0, coordinator=None, cluster_token="",
                 **client_kwargs):
        if isinstance(model_or_named_params, torch.nn.Module):
            named = list(model_or_named_params.named_parameters())
        else:
            named = list(model_or_named_params)
        if not named:
            raise ValueError("no parameters to train")
        name_of = {id(p): n for n, p in named}
        groups, grouped = [], set()
        for g in param_groups or []:
            g = dict(g)
            ps = list(g["params"])
            for p in ps:
                if id(p) not in name_of:
                    raise ValueError("a param group names a tensor that is not a parameter of "
                                     "the model")
                grouped.add(id(p))
            g["params"] = ps
            groups.append(g)
        rest = [p for _, p in named if id(p) not in grouped]
        if rest:
            groups.append({"params": rest})
        super().__init__(groups, {"lr": 0.0 if lr is None else float(lr)})
        self._name_of = name_of
        self._sent_lr = {}
        if client is None:
            # No coordinator given: the client takes it (and the token, rank, transport) from
            # the environment a launcher set (SHARDPS_COORDINATOR ...; python -m shardps.run).
            client = Client(coordinator or "", cluster_token=cluster_token, **client_kwargs)
        self.client = client
        self._params = []
        for name, p in named:
            if p.dtype != torch.float32:
                raise TypeError(f"parameter '{name}' is {p.dtype}; ShardPS trains float32")
            if not p.is_contiguous():
                raise ValueError(f"parameter '{name}' is not contiguous")
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            # p.detach() shares p's storage: the pulls write the parameter itself.
            client.register(name, p.detach(), p.grad)
            self._params.append((name, p, p.grad))
            log.info("shardps: '%s' %s on %s: path %s", name, tuple(p.shape), p.device,
                     client.tensor_path(name))
        self._cuda = any(p.is_cuda for _, p, _ in self._params)
        client.start()  # rank 0's weights become every worker's
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

    def zero_grad(self, set_to_none=True):
        """Zeroes the registered gradient buffers in place. set_to_none is accepted and not
        honoured: the registered memory must stay the gradient (zeros push the same as none)."""
        for _, p, g in self._params:
            g.zero_()
            if p.grad is not g:
                p.grad = g

    def _gather_grads(self):
        for name, p, g in self._params:
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._gather_grads()
        self._send_lr()
        if self._cuda:
            torch.cuda.synchronize()  # the gradients must be complete before they are copied
        self.client.step()
        return loss

    def _send_lr(self):
        # Each group's current rate (a scheduler may have changed it) goes with the next pushes
        # of its parameters; only changes touch the client.
        for g in self.param_groups:
            lr = float(g["lr"])
            if lr < 0:
                raise ValueError(f"negative learning rate {lr}")
            for p in g["params"]:
                name = self._name_of[id(p)]
                if self._sent_lr.get(name) != lr:
                    self.client.set_lr(name, lr)
                    self._sent_lr[name] = lr

    def close(self):
        self.client.close()
