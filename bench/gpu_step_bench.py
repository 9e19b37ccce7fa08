#!/usr/bin/env python3
"""gpu_step_bench: what DistributedOptimizer.step() costs a GPU learner, against the same model's
step with its parameters in host memory, in one run (scripts/gpu-check.sh runs it).

One shard server and one worker on this host (shm by default, BSP, SGD). A model of L Linear
layers of width D (float32: 4*D*D*L bytes, 64 MiB by default) with fixed gradients; per device
(cuda, cpu) it times --steps calls of opt.step() after --warmup untimed ones and prints the
median step time and the goodput 8 * (pushed + pulled bytes) / step time; then, for the cuda
run, the same with torch's own host<->device copy of the whole model (D2H of the gradients plus
H2D of the weights, pinned), the floor of any staged path.

Checks the weights after the run: every element moved by exactly steps * lr * grad, so a step
that skipped the device copy fails the run (exit 1).

usage: PYTHONPATH=BUILD/python bench/gpu_step_bench.py [--width 2048] [--layers 4]
       [--steps 20] [--transport shm] [--pipeline-bytes 1048576]
"""
import argparse
import statistics
import sys
import time

import torch

import shardps
import shardps.launch
import shardps.torch as spt


def run(device, a):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width, bias=False)
                                  for _ in range(a.layers)]).to(device)
    lr = 2.0 ** -10
    with shardps.launch.LocalCluster(servers=1, workers=1, lr=lr, optimizer="sgd",
                                     transport=a.transport, timeout=60, grace=1.0) as cl:
        client = shardps.Client(cl.address, cluster_token=cl.token, transport=a.transport,
                                bind_ip="127.0.0.1", setup_timeout_ms=60000,
                                wait_timeout_ms=60000, cuda_pipeline_bytes=a.pipeline_bytes)
        opt = spt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model,
                                       client=client)
        start = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad.fill_(0.5)  # in place: the optimizer registered these buffers
        times = []
        for i in range(a.warmup + a.steps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        paths = sorted({client.tensor_path(name) for name, _, _ in opt._params})
        steps = a.warmup + a.steps
        ok = all(torch.allclose(p.detach(), s - steps * lr * 0.5, rtol=0, atol=1e-6)
                 for p, s in zip(model.parameters(), start))
        opt.close()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    med = statistics.median(times)
    print(f"{device:5s} {a.transport} {nbytes / 2**20:7.1f} MiB model: step p50 {med * 1e3:8.2f} ms "
          f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}), "
          f"{8 * 2 * nbytes / med / 1e9:6.2f} Gbit/s push+pull{' paths ' + ','.join(paths) if paths else ''}"
          f"; weights {'exact' if ok else 'WRONG'}", flush=True)
    return med, ok, nbytes


def copy_floor(nbytes, steps):
    n = nbytes // 4
    dev = torch.empty(n, device="cuda")
    host = torch.empty(n, pin_memory=True)
    times = []
    for i in range(3 + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--pipeline-bytes", type=int, default=1 << 20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step_bench: SKIP: torch sees no CUDA device")
        return 77
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuda_pipeline_bytes {a.pipeline_bytes}", flush=True)
    cpu, ok_cpu, nbytes = run("cpu", a)
    gpu, ok_gpu, _ = run("cuda", a)
    floor = copy_floor(nbytes, a.steps)
    print(f"cuda/cpu step time {gpu / cpu:.2f}x; torch's pinned D2H+H2D of the model "
          f"{floor * 1e3:.2f} ms ({2 * nbytes / floor / 1e9:.1f} GB/s): cuda step - cpu step = "
          f"{(gpu - cpu) * 1e3:.2f} ms against that copy floor", flush=True)
    return 0 if ok_cpu and ok_gpu else 1


if __name__ == "__main__":
    sys.exit(main())
