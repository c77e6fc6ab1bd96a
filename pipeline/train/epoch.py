"""One epoch's bookkeeping in the generic training loop (``pipeline.train.loop``): its batches, taken a step's
micro-batches at a time, the running per-sample sums of the loss and the recipe's metrics, and the progress line."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from pipeline.train import distributed


def samples(batch: dict[str, torch.Tensor]) -> int:
    return int(next(iter(batch.values())).shape[0])


@dataclass
class Sums:
    """Per-sample sums over the batches seen, in float64. They stay on the device: a ``.item()`` per step would make
    every step wait for it."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    count: int = 0

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        for key, value in stats.items():
            total = self.values.get(key)
            if total is None:
                self.values[key] = value.detach().to(torch.float64, copy=True)  # a copy: it is added to in place
            else:
                total.add_(value.detach())  # in place, in the sum's float64: one operation a step, not a cast and an add

    def means(self, dist, prefix: str) -> dict[str, float]:
        """Per-sample means of every rank's sums (one all-reduce), the loss first."""
        keys = sorted(self.values)
        totals = distributed.all_reduce_sum(dist, [float(self.values[k].item()) for k in keys] + [float(self.count)])
        n = max(totals[-1], 1.0)
        ordered = ["loss"] + [k for k in keys if k != "loss"]
        values = dict(zip(keys, totals[:-1]))
        return {f"{prefix}{k}": values[k] / n for k in ordered if k in values}


@dataclass
class Epoch:
    """The epoch being trained: its batches (None once dropped), its optimizer steps done (a resumed epoch starts
    past 0), whether the ranks agreed to stop at its last step, and its sums."""

    batches: Iterator[dict[str, torch.Tensor]] | None
    step: int
    stopping: bool = False
    sums: Sums = field(default_factory=Sums)

    def micro_batches(self, count: int) -> list[dict[str, Any]]:
        """Up to ``count`` batches (fewer at the epoch's end, none after it)."""
        micro = []
        for _ in range(count):
            try:
                micro.append(next(self.batches))
            except StopIteration:
                break
        return micro


def plan_line(*, steps_per_epoch: int, epochs: int, total_steps: int, world_size: int,
              resumed: dict[str, Any] | None) -> str:
    """The run's plan in its steps' one unit: optimizer steps taken, each counted in the world that took it. The
    progress lines, the step metrics, the heartbeats (the job view's progress and ETA) and the result count in it.
    Resumed on another number of ranks, the steps already taken are the first world's and the steps to go this
    one's: the line says both, and where the run ends."""
    plan = f"{steps_per_epoch} steps/epoch x {epochs} epochs"
    if resumed is None:
        return f"{plan} = {total_steps} steps"
    step, left = resumed["step"], total_steps - resumed["step"]
    if resumed["world_size"] == world_size:
        return f"{plan} = {total_steps} steps; resumed from step {step} (epoch {resumed['epoch'] + 1}), {left} to go"
    return (f"{plan} on {world_size} rank(s); resumed from step {step}, steps taken by {resumed['world_size']} rank(s) "
            f"(epoch {resumed['epoch'] + 1}, at this world's step {resumed['in_epoch']} of it): {left} steps of "
            f"{world_size} rank(s) to go, so the run ends at step {total_steps}")


def progress_line(epoch, epochs, step, total_steps, start_step, loss, figures, loop_started) -> None:
    """Rank 0's line for a window of steps (``figures``: ``Throughput.window``), with the time left at its pace."""
    elapsed = time.perf_counter() - loop_started
    eta = (total_steps - step) * elapsed / max(step - start_step, 1)
    extra = f" mfu {figures['mfu']:.1%}" if "mfu" in figures else ""
    extra += f" {figures['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in figures else ""
    print(f"epoch {epoch + 1}/{epochs} step {step}/{total_steps} loss {loss:.4f} "
          f"{figures['samples_per_s']:,.0f} samples/s step {figures['step_time_s'] * 1e3:.1f}ms "
          f"data-wait {figures['data_wait_fraction']:.0%}{extra} eta {eta:.0f}s", flush=True)
