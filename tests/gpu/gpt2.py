"""A GPT-2-shaped rank for validating nccltrace on a GPU (issue 51): 12 transformer
layers (d_model 768, 12 heads, random weights: nothing downloads), bf16 autocast, AdamW,
DistributedDataParallel at world size 1, batches from a DataLoader of --workers worker
processes with pinned memory. It trains --warmup steps, prints "ready", waits for
--go-file, sleeps --pause-ms (a pause before the loop: no collectives), then trains
--steps steps and prints, as JSON, its own figures: step times by its clock, the pause,
its all-reduce calls (a counting comm hook) and its DataLoader workers' pids (each writes
its own at start). With --cupti N, N more steps run under torch.profiler and the JSON
adds what CUPTI saw of them (see train.py's `profiled`).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import one_rank_world, profiled, warm_then_wait  # noqa: E402

VOCAB, SEQ = 50257, 256


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, as a tokenised corpus would give them."""

    def __len__(self):
        return 1 << 30

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=g)


class Gpt(torch.nn.Module):
    def __init__(self, layers=12, d=768, heads=12):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, d)
        self.pos = torch.nn.Embedding(SEQ, d)
        layer = torch.nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB, bias=False)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False
        )

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tok(x) + self.pos(pos)
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--go-file")
    p.add_argument("--pause-ms", type=int, default=0)
    p.add_argument("--pid-dir")
    p.add_argument("--cupti", type=int, default=0)
    a = p.parse_args()

    dev = one_rank_world()
    torch.manual_seed(0)
    model = DDP(Gpt().to(dev), device_ids=[0])
    counted = {"allreduce": 0}

    def hook(state, bucket):
        counted["allreduce"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def note_pid(_):
        if a.pid_dir:
            open(os.path.join(a.pid_dir, f"worker-{os.getpid()}"), "w").close()

    loader = torch.utils.data.DataLoader(
        Tokens(), batch_size=a.batch, num_workers=a.workers, pin_memory=True,
        persistent_workers=a.workers > 0, worker_init_fn=note_pid,
    )
    batches = iter(loader)

    # The job's own clock around the main thread's hand-off to the autograd thread and
    # around `.item()`'s sync, per step (ms medians in the JSON).
    clocks = {"backward": [], "item": []}

    def step():
        b = next(batches).to(dev, non_blocking=True)
        x, y = b[:, :-1], b[:, 1:]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        t = time.monotonic_ns()
        loss.backward()
        clocks["backward"].append(time.monotonic_ns() - t)
        opt.step()
        t = time.monotonic_ns()
        v = loss.item()
        clocks["item"].append(time.monotonic_ns() - t)
        return v

    pause_start = warm_then_wait(step, a.warmup, a.go_file, a.pause_ms)
    counted["allreduce"] = 0
    times = []
    for c in clocks.values():
        c.clear()
    for _ in range(a.steps):
        t0 = time.monotonic_ns()
        step()
        times.append(time.monotonic_ns() - t0)
    own = {f"{k}_ms_median": statistics.median(v) / 1e6 for k, v in clocks.items()}
    cupti = profiled(step, a.cupti) if a.cupti else None
    workers = sorted(
        int(f.split("-")[1]) for f in os.listdir(a.pid_dir) if f.startswith("worker-")
    ) if a.pid_dir else []
    print(json.dumps({
        "cupti": cupti,
        "steps": a.steps,
        "allreduce_calls": counted["allreduce"],
        "step_ms_median": statistics.median(times) / 1e6,
        "step_ms_mean": statistics.mean(times) / 1e6,
        **own,
        "pause": {"start_ns": pause_start, "ms": a.pause_ms},
        "workers": workers,
        "torch": torch.__version__,
    }), flush=True)
    del batches, loader
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
