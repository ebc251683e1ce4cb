"""A real rank for validating nccltrace on a GPU: PyTorch + NCCL, world size 1.

Modes: `ddp` trains a 6-layer MLP under DistributedDataParallel (gradients all-reduced in
buckets through a counting comm hook); `allreduce` all-reduces every gradient by hand.
Both call `loss.item()` each step, as real scripts do. Warm-up steps (NCCL and CUDA init)
run before the script waits for --go-file, so nccltrace attaches to a running job; then it
runs --steps steps and prints, as JSON, what it did: its own count of all-reduce calls and
its step times. With --step-log, each step's end (CLOCK_MONOTONIC ns) and length are also
appended to that file, 256 steps at a time (tests/gpu/windows.sh). With --cupti N, N more
steps run under torch.profiler afterwards and the JSON adds what CUPTI saw of them
("cupti"): per step, the GPU time of NCCL kernels and of all kernels, and the host's time
inside CUDA synchronisation calls (tests/gpu/gpuwait.sh). With --pause-ms, the script sleeps that long after --go-file
before its loop (a pause with no collectives; "pause" in the JSON).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "allreduce"], default="ddp")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--go-file")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--step-log")
    p.add_argument("--cupti", type=int, default=0)
    p.add_argument("--pause-ms", type=int, default=0)
    a = p.parse_args()

    dev = one_rank_world()

    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(dev)
    counted = {"allreduce": 0}
    if a.mode == "ddp":
        model = DDP(model, device_ids=[0])

        def hook(state, bucket):
            counted["allreduce"] += 1
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, a.width, device=dev)
    y = torch.randn(256, a.width, device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if a.mode == "allreduce":
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                counted["allreduce"] += 1
        opt.step()
        return loss.item()

    pause_ns = (warm_then_wait(step, a.warmup, a.go_file, a.pause_ms), a.pause_ms * 1_000_000)
    counted["allreduce"] = 0
    times = []
    log = open(a.step_log, "a", buffering=1 << 16) if a.step_log else None
    for i in range(a.steps):
        t0 = time.monotonic_ns()
        step()
        t1 = time.monotonic_ns()
        times.append(t1 - t0)
        if log:
            log.write(f"{t1} {t1 - t0}\n")
            if i % 256 == 255:
                log.flush()
    cupti = profiled(step, a.cupti) if a.cupti else None
    print(json.dumps({
        "cupti": cupti,
        "mode": a.mode,
        "steps": a.steps,
        "allreduce_calls": counted["allreduce"],
        "step_ms_median": statistics.median(times) / 1e6,
        "step_ms_mean": statistics.mean(times) / 1e6,
        "pause": {"start_ns": pause_ns[0], "ms": pause_ns[1] / 1e6},
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }), flush=True)
    dist.destroy_process_group()


def warm_then_wait(step, warmup, go_file, pause_ms):
    """Runs `warmup` steps (NCCL and CUDA init), prints "ready", waits for `go_file` (so
    nccltrace attaches to a running job), then sleeps `pause_ms` (a pause before the loop,
    as scripts load data or sleep: no collectives, not a step); returns when the pause
    began (CLOCK_MONOTONIC ns)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    if go_file:
        while not os.path.exists(go_file):
            time.sleep(0.001)
    start = time.monotonic_ns()
    time.sleep(pause_ms / 1e3)
    return start


def one_rank_world():
    """Joins a process group of one rank on GPU 0 (NCCL backend), its rendezvous its own
    unless the environment names one; returns the device."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    return dev


def profiled(step, n):
    """Runs `n` steps under torch.profiler: per step, ms of NCCL kernels and of all
    kernels on the GPU (CUPTI's activity records), and ms the host spent inside CUDA
    synchronisation calls (the runtime API's own records)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.monotonic_ns()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        wall = time.monotonic_ns() - t0
    nccl = kernels = sync = launch = 0.0
    launches, longest, busy = 0, 0.0, []
    for e in prof.events():
        dev = str(getattr(e, "device_type", "")).endswith("CUDA")
        if dev and "nccl" in e.name.lower():
            nccl += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if dev:
            kernels += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            busy.append((e.time_range.start, e.time_range.end))
        elif "Synchronize" in e.name and e.name.startswith("cuda"):
            sync += e.cpu_time_total
        elif e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
            launch += e.cpu_time_total
            launches += 1
            longest = max(longest, e.cpu_time_total)
    # The GPU's busy time: the union of its kernels' and copies' intervals.
    busy_us, end = 0.0, float("-inf")
    for s, t in sorted(busy):
        if t > end:
            busy_us += t - max(s, end)
            end = t
    # Event times are µs.
    return {
        "steps": n,
        "wall_ms_per_step": wall / 1e6 / n,
        "nccl_kernel_ms_per_step": nccl / 1e3 / n,
        "kernel_ms_per_step": kernels / 1e3 / n,
        "gpu_busy_ms_per_step": busy_us / 1e3 / n,
        "sync_ms_per_step": sync / 1e3 / n,
        "launch_ms_per_step": launch / 1e3 / n,
        "launches_per_step": launches / n,
        "longest_launch_ms": longest / 1e3,
    }


if __name__ == "__main__":
    sys.exit(main())
