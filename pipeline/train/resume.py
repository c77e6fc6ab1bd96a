"""Which checkpoint a run of the generic training loop (``pipeline.train.loop``) resumes from, and where in its
epoch that puts the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import TrainConfig
from pipeline.train import distributed
from pipeline.train.checkpoint import load_state
from pipeline.train.context import RunContext


def latest_checkpoint(ctx: RunContext, digest: str,
                      dataset_versions: list[str]) -> tuple[Path, dict[str, Any], str] | None:
    """The newest intact checkpoint of this job, the one rank 0 chose, on every rank: (its folder on this node, its
    state, where it is kept); None when there is none, or when it was written for another config ``digest``
    (``PipelineConfig.digest``: other model settings) or from other dataset versions (other rows)."""
    found = None
    if ctx.is_main:
        found = ctx.checkpoints.load_latest()
        reason = found and _not_resumable(found.state, digest, list(dataset_versions))
        if reason:
            print(f"WARNING: not resuming from checkpoints in {ctx.checkpoints.location}: {reason}", flush=True)
            found = None
    name = distributed.broadcast_object(ctx.dist, found.path.name if found else None)
    if name is None:
        return None
    path = found.path if found else ctx.checkpoints.local_copy(name)  # on this node: a download on an object store
    return path, (found.state if found else load_state(path)), ctx.checkpoints.where(name)


def _not_resumable(state: dict[str, Any], digest: str, dataset_versions: list[str]) -> str | None:
    """Why a checkpoint's ``state`` cannot continue this run, or None."""
    if state.get("config_digest") != digest:
        return (f"they were written for config digest {state.get('config_digest')}, this run's model settings give "
                f"{digest} (a field that changes the trained model differs)")
    written_from = state.get("dataset_versions")
    if written_from is not None and list(written_from) != dataset_versions:
        return (f"they were trained on dataset version(s) {', '.join(written_from)}, this run reads "
                f"{', '.join(dataset_versions)} (other rows)")
    return None


def steps_done_in_epoch(state: dict[str, Any], *, steps_per_epoch: int, world_size: int, tc: TrainConfig) -> int:
    """Optimizer steps of the checkpoint's epoch already trained, in this world's steps: from the loader's
    position (samples of the epoch over all ranks), so a resume on another number of ranks (an elastic
    restart after losing a node) continues at the same sample; from the step count without one."""
    loader = state.get("loader") or {}
    if "sample_in_epoch" not in loader:
        return state["step"] - state["epoch"] * steps_per_epoch
    per_step = world_size * tc.batch_size * tc.grad_accum_steps
    return min(steps_per_epoch, int(loader["sample_in_epoch"]) // per_step)
