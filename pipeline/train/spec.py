"""``TrainSpec``: a recipe's heavy half, the hooks that the generic loop, registration and evaluation call.

A recipe either gives the loop its hooks (``build_model``, ``batch_transform``, ``loss``) and gets DDP or
FSDP (its ``shard_units`` name the blocks), accumulation, autocast, LR schedule, checkpoints with the loader's state, heartbeats, throughput and
the result file from ``pipeline.train.loop``; or it gives ``run``, a per-rank body for a framework
trainer (Lightning, Hugging Face Trainer) that reaches the same ``RunContext`` through callbacks.

Every hook takes the run's config first, then what it works on: ``hook(cfg, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from pipeline.config import PipelineConfig
from pipeline.evaluate.evaluator import Evaluator
from pipeline.registry.package import ModelPackage
from pipeline.results import TrainedModel

if TYPE_CHECKING:
    import torch

    from pipeline.data.read.training_data import TrainingData
    from pipeline.train.context import RunContext
    from pipeline.train.distributed import DistContext

Batch = dict[str, Any]  # a batch of tensors (what batch_transform made of a batch of decoded columns)


class BuildModel(Protocol):
    def __call__(self, cfg: PipelineConfig, data: TrainingData, /) -> torch.nn.Module:
        """The model, built the same on every rank (the loop seeds first)."""


class BatchTransform(Protocol):
    def __call__(self, cfg: PipelineConfig, data: TrainingData, train: bool, /) -> Callable[[dict[str, Any]], Batch]:
        """A picklable callable, decoded columns -> a dict of tensors, that draws no random numbers: it runs
        ahead of the training step, on the loader's read-ahead thread or in its workers, so a draw from torch's
        global generator there would make a seeded run unrepeatable. Random augmentation belongs in ``loss``,
        on the device (the image recipe's), where checkpoints restore the generator's state."""


class Loss(Protocol):
    def __call__(self, cfg: PipelineConfig, model: torch.nn.Module, batch: Batch, /) -> tuple[torch.Tensor, Batch]:
        """(loss summed over the batch's samples, {metric: sum over the samples}); ``model.training`` tells a
        training step from validation."""


class Export(Protocol):
    def __call__(self, cfg: PipelineConfig, model: torch.nn.Module, data: TrainingData, out_dir: Path, /) -> dict[str, str]:
        """Rank 0 writes what packaging needs into ``out_dir`` (no pickled classes): {name: file}."""


class Run(Protocol):
    def __call__(self, cfg: PipelineConfig, ctx: RunContext, data: TrainingData, /) -> dict[str, Any]:
        """A framework trainer's per-rank body instead of the loop: result fields, ``metrics`` (the last
        validation's), and on rank 0 ``model_files`` (what export would return) for ``package``."""


class Package(Protocol):
    def __call__(self, cfg: PipelineConfig, trained: TrainedModel, data: TrainingData, /) -> ModelPackage:
        """What registration logs for the trained model (its ``model_files``)."""


class EvaluationInputs(Protocol):
    def __call__(self, cfg: PipelineConfig, data: TrainingData, split: str, /) -> tuple[Any, Any]:
        """(what the registered model takes, what the evaluator scores it against: label indices, held-out
        items, references) of ``split``."""


class Tokens(Protocol):
    def __call__(self, cfg: PipelineConfig, batch: Batch, /) -> int:
        """Tokens in the batch, for tokens/s and MFU per token (language models)."""


class ShardUnits(Protocol):
    def __call__(self, cfg: PipelineConfig, model: torch.nn.Module, /) -> list[torch.nn.Module]:
        """The model's blocks (submodules), each an FSDP unit whose parameters are gathered together just for its
        forward and backward (``train.parallelism = fsdp``), and the blocks ``train.activation_checkpointing``
        recomputes: a transformer's layers, a network's stages. What they leave out is the model's own unit."""


class Baseline(Protocol):
    def __call__(self, cfg: PipelineConfig, model: torch.nn.Module, data: TrainingData, dist: DistContext, /) -> dict[str, float]:
        """{metric: value} of the untrained model, called on every rank before the first step of a fresh run (not
        on resume); rank 0's are logged as ``baseline_<metric>`` and returned as ``baseline_metrics``."""


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    # The generic loop's hooks (all four, unless ``run`` is given).
    build_model: BuildModel | None = None
    batch_transform: BatchTransform | None = None
    loss: Loss | None = None
    export: Export | None = None
    # Or a framework trainer's per-rank body.
    run: Run | None = None
    # Registration and evaluation.
    package: Package | None = None
    evaluation_inputs: EvaluationInputs | None = None
    evaluator: Evaluator | None = None  # metrics with directions, scoring, the report (pipeline.evaluate)
    # None: throughput counts samples only.
    tokens: Tokens | None = None
    baseline: Baseline | None = None
    # None: each child module of the model that holds parameters is a block.
    shard_units: ShardUnits | None = None

    def __post_init__(self) -> None:
        loop_hooks = (self.build_model, self.batch_transform, self.loss, self.export)
        if self.run is None and not all(loop_hooks):
            raise TypeError("a TrainSpec needs run, or build_model, batch_transform, loss and export for the loop")
