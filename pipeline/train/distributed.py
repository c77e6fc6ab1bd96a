"""Process-group setup that works with and without torchrun (DDP is on when RANK is set): torchrun's ranks
initialise the group here, Ray Train's workers find it initialised."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None when running as a single plain process

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(backend: str | None = None) -> DistContext:
    """Join the torchrun job if there is one; pick nccl with a GPU and gloo without when ``auto``. The backend is
    the place's (``PIPELINE_BACKEND``, from ``launch.backend``) unless given."""
    backend = backend or os.environ.get("PIPELINE_BACKEND", "auto")
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return DistContext(0, 0, 1, torch.device("cuda" if cuda else "cpu"), None)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not dist.is_initialized():  # Ray Train initialises it before the worker's function runs
        dist.init_process_group(backend=backend)
    return DistContext(dist.get_rank(), local_rank, dist.get_world_size(), device, backend)


def teardown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(ctx: DistContext, values: list[float]) -> list[float]:
    """Sum a few scalars over all ranks (float64, on the device the backend needs)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def broadcast_object(ctx: DistContext, obj):
    """Rank 0's ``obj`` on every rank."""
    if not ctx.enabled:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather(ctx: DistContext, obj) -> list:
    """Every rank's ``obj``, in rank order (a one-element list without DDP)."""
    if not ctx.enabled:
        return [obj]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def state_digest(state: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """Hash of a module's parameters and buffers (or of its state dict): equal on every rank when DDP kept them in
    sync."""
    import hashlib

    digest = hashlib.sha256()
    tensors = state.state_dict() if isinstance(state, torch.nn.Module) else state
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
