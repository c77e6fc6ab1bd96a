"""Per-step cost of the preemption agreement: a 2-rank gloo DDP loop of a small MLP, with no check, with
should_stop() (overlapped all-reduce), and with should_stop(overlap=False) (blocking), interleaved.

    PYTHONPATH=. .venv/bin/torchrun --standalone --nproc-per-node=2 bench/preemption_overhead.py [--steps 1500 --batch 16 --repeats 3]
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipeline.train.preemption import Preemption

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1500)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 3))
ddp = DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
x, y = torch.randn(args.batch, 16), torch.randint(0, 3, (args.batch,))


def run(mode: str) -> tuple[float, float]:
    request = Preemption(None)
    in_check = 0.0
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if mode != "none":
            t = time.perf_counter()
            request.should_stop(overlap=(mode == "overlapped"))
            in_check += time.perf_counter() - t
    request.finish()
    total = time.perf_counter() - started
    return total / args.steps * 1e6, in_check / args.steps * 1e6


results = {m: [] for m in ("none", "overlapped", "blocking")}
for _ in range(args.repeats):
    for mode in results:
        results[mode].append(run(mode))
if rank == 0:
    base = statistics.median(r[0] for r in results["none"])
    for mode, runs in results.items():
        step = statistics.median(r[0] for r in runs)
        check = statistics.median(r[1] for r in runs)
        print(f"{mode:10s} step {step:7.1f} us  (+{step - base:6.1f} us, {100 * (step - base) / base:+5.1f}%)  "
              f"time inside should_stop {check:5.1f} us; runs {[round(r[0]) for r in runs]}", flush=True)
dist.destroy_process_group()
