"""``train.parallelism``: how the loop's ranks hold the model. ``ddp`` keeps a whole replica on every rank and
all-reduces the gradients; ``fsdp`` (FSDP2, ``torch.distributed.fsdp.fully_shard``) shards parameters,
gradients and optimizer state over the ranks, gathering a block's parameters just for its forward and
backward, so a model N times larger than one device fits on N of them.

The loop asks the same five things of either: the module to call (``wrapped``), whether this micro-batch
synchronises gradients (``accumulating``), the model's state for a checkpoint and back (``state`` /
``load``), the whole model on rank 0 for the export (``full_state_dict``) and, for work that does not run the
same forwards on every rank (generating text), the whole model on every rank for a while (``whole``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import TrainConfig
from pipeline.errors import ConfigError
from pipeline.private_apis import fsdp_lazy_init
from pipeline.train.checkpoint import is_sharded, load_shards
from pipeline.train.distributed import DistContext


def default_units(model: nn.Module) -> list[nn.Module]:
    """The blocks when a recipe names none: each child of the model that holds parameters, and each of a
    container's (a ModuleList is never called itself, so it cannot gather its parameters for a forward)."""
    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += default_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


def checkpoint_activations(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Each unit's forward run under ``torch.utils.checkpoint`` (non-reentrant): it keeps only its inputs in the
    forward and recomputes its activations in the backward. The units stay where they are, so the model's module
    tree, state dict keys, parameter names and the checkpoints' keys are the plain model's; returns the units."""
    from torch.utils.checkpoint import checkpoint

    inside = {id(module) for module in model.modules() if module is not model}
    for unit in units:
        if id(unit) not in inside:
            raise ConfigError("train.activation_checkpointing: the recipe's blocks must be submodules of its model, "
                              f"not the model itself ({type(unit).__name__})")
        # An instance attribute: nn.Module.__call__ runs it between the unit's hooks, so FSDP's gather before the
        # forward and its reshard after stay outside the recomputed part, as around a wrapper module.
        unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False)
    return list(units)


class Replicated:
    """``ddp``: the whole model on every rank, gradients all-reduced (DistributedDataParallel); on one plain
    process, the model as it is."""

    name = "ddp"
    sharded = False

    def __init__(self, model: nn.Module, dist: DistContext):
        from torch.nn.parallel import DistributedDataParallel

        self.model = model
        self.wrapped = DistributedDataParallel(model) if dist.enabled else model
        self._enabled = dist.enabled

    def accumulating(self, sync: bool):
        """The context of one micro-batch's forward and backward: DDP all-reduces only when ``sync``."""
        return contextlib.nullcontext() if sync or not self._enabled else self.wrapped.no_sync()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        yield  # every rank holds the whole model already


class Sharded:
    """``fsdp``: ``fully_shard`` on each of the recipe's units, then on the model (what is left: embeddings, the
    head), over a 1-D mesh of every rank. bf16 (``train.precision``) computes in bf16 and reduces gradients in
    fp32; ``cpu_offload`` keeps the shards in host memory (a GPU only)."""

    name = "fsdp"
    sharded = True

    def __init__(self, model: nn.Module, units: list[nn.Module], dist: DistContext, tc: TrainConfig, bf16: bool):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if not dist.enabled:
            raise ConfigError("train.parallelism='fsdp' shards the model over a process group; this process has "
                              "none (run it under torchrun or Ray Train, even with one rank)")
        if tc.cpu_offload and dist.device.type != "cuda":
            raise ConfigError(f"train.cpu_offload=true: it moves the shards off a GPU; the ranks run on "
                              f"{dist.device.type}, where they are in host memory already")
        if tc.activation_checkpointing:
            units = checkpoint_activations(model, units)
        mesh = init_device_mesh(dist.device.type, (dist.world_size,))
        options = {
            "mesh": mesh, "reshard_after_forward": tc.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
            else MixedPrecisionPolicy(),
            "offload_policy": CPUOffloadPolicy() if tc.cpu_offload else OffloadPolicy(),
        }
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(model, **options)
        # What the root's first forward would do: done now, so that a forward entering below the root (peft's
        # generate calls the wrapped model's own) finds every unit under it.
        fsdp_lazy_init(model)
        self.model = self.wrapped = model
        self.units = len(units)
        self._reshard_after_forward = tc.reshard_after_forward

    def accumulating(self, sync: bool):
        """FSDP reduce-scatters the gradients only when ``sync``; before, each rank accumulates unsharded ones."""
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters on rank 0, in host memory (a collective: every rank calls it; the others
        get an empty dict)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit's parameters gathered once and kept while the block runs, so that each rank may run forwards
        of its own count and shape (text generation stops at a different token on each) without a collective
        per forward; sharded again after. Costs the whole model's memory on every rank meanwhile."""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.set_reshard_after_forward(False)
            module.unshard()
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
                module.set_reshard_after_forward(self._reshard_after_forward)


def parallelize(model: nn.Module, dist: DistContext, tc: TrainConfig, *, bf16: bool,
                units: Callable[[nn.Module], list[nn.Module]] | None = None) -> Replicated | Sharded:
    """``model`` held as ``train.parallelism`` says; ``units`` names its blocks (the recipe's ``shard_units``
    hook), each child with parameters when None. Activation checkpointing applies to the same blocks."""
    blocks = (units or default_units)(model)
    if tc.parallelism == "fsdp":
        return Sharded(model, blocks, dist, tc, bf16)
    if tc.activation_checkpointing:
        checkpoint_activations(model, blocks)
    return Replicated(model, dist)


def sharded_state(parallel: Replicated | Sharded, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{model, optimizer}: each rank's shards as DTensors, keyed by parameter names (what
    ``torch.distributed.checkpoint`` saves and loads on any number of ranks)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(parallel.model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_model_and_optimizer(parallel: Replicated | Sharded, optimizer: torch.optim.Optimizer, path: Path,
                             state: dict[str, Any]) -> None:
    """Checkpoint ``path``'s model and optimizer (``state``: its ``state.pt``) into this run: a sharded
    checkpoint's shards, resharded to this run's ranks (it was written by an fsdp run: its config digest, so this
    run is fsdp too); a whole one's tensors (ddp's, or a consolidated fsdp checkpoint), which fsdp cuts to this
    rank's shards."""
    if is_sharded(path):
        shards = sharded_state(parallel, optimizer)
        load_shards(path, shards)
        load_sharded_state(parallel, optimizer, shards)
    elif parallel.sharded:
        load_sharded_state(parallel, optimizer, state, full=True)
    else:
        parallel.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def load_sharded_state(parallel: Replicated | Sharded, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                       *, full: bool = False) -> None:
    """Put ``state`` (``sharded_state``'s form, filled by a load) into the model and optimizer; ``full``: it holds
    whole tensors (a consolidated checkpoint), which each rank cuts to its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(parallel.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=full))
