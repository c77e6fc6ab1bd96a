"""How long a process that has imported torch takes to end once its work is done: the interpreter's own exit
against ``pipeline.fast_exit`` (not a test; the figures are in docs/performance.md).

    .venv/bin/python bench/exit_time.py [--repeats 5]

Two cases, the two ways alternated. One process like a rank (torch, ``torch._dynamo`` and streaming imported,
a small DDP model trained on a one-rank gloo group): from its last line to its end, wall time and the CPU time
it spent meanwhile (the CPU time is the steadier figure on a busy machine). A 2-rank job: from rank 0's last
line to the end of the torchrun agent, ``python -m torch.distributed.run`` with ranks that exit as usual
against ``python -m pipeline.job.local.torchrun`` with ranks that end with ``exit_now``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("interpreter", "fast_exit")


def rank(way: str) -> None:
    """The rank body: work, then rank 0 writes when it finished (wall and CPU time) and the process ends."""
    import torch
    import torch._dynamo  # noqa: F401 - what a rank's export loads
    import torch.distributed as dist
    import streaming  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                                        torch.nn.Linear(256, 1)))
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(20):
        optimizer.zero_grad()
        model(torch.randn(32, 64)).sum().backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()
    if os.environ["RANK"] == "0":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        Path(os.environ["EXIT_MARK"]).write_text(f"{time.time()} {usage.ru_utime + usage.ru_stime}")
    if way == "fast_exit":
        from pipeline.fast_exit import exit_now

        exit_now(0)
    sys.exit(0)


def one_process(way: str, mark: Path, port: int) -> tuple[float, float]:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               EXIT_MARK=str(mark), PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, __file__, "--rank", way], env=env)
    _, status, usage = os.wait4(child.pid, 0)
    ended = time.time()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"the {way} process failed")
    marked, cpu = map(float, mark.read_text().split())
    return ended - marked, usage.ru_utime + usage.ru_stime - cpu


def job(way: str, mark: Path) -> float:
    launcher = "pipeline.job.local.torchrun" if way == "fast_exit" else "torch.distributed.run"
    env = dict(os.environ, EXIT_MARK=str(mark), PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", launcher, "--standalone", "--nproc-per-node=2", __file__, "--rank", way],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - float(mark.read_text().split()[0])


def _line(name: str, values: list[float]) -> str:
    return (f"{name} median {statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f}; "
            + ", ".join(f"{v:.2f}" for v in values) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank(args.rank)
    wall = {w: [] for w in WAYS}
    cpu = {w: [] for w in WAYS}
    ends = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for way in WAYS:
                w, c = one_process(way, Path(tmp) / f"one-{way}-{i}", 29400 + 2 * i + WAYS.index(way))
                wall[way].append(w)
                cpu[way].append(c)
                ends[way].append(job(way, Path(tmp) / f"job-{way}-{i}"))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end")
    for way in WAYS:
        print(f"{way}: one process, last line to its end: " + _line("wall", wall[way]) + "; " + _line("CPU", cpu[way]))
        print(f"{way}: 2-rank job, rank 0's last line to the agent's end: " + _line("wall", ends[way]))


if __name__ == "__main__":
    main()
