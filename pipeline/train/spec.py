"""``TrainSpec``: a recipe's heavy half, the hooks that the generic loop, registration and evaluation call.

A recipe either gives the loop its hooks (``build_model``, ``batch_transform``, ``loss``) and gets DDP,
accumulation, autocast, LR schedule, checkpoints with the loader's state, heartbeats, throughput and
the result file from ``pipeline.train.loop``; or it gives ``run``, a per-rank body for a framework
trainer (Lightning, Hugging Face Trainer) that reaches the same ``RunContext`` through callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True, kw_only=True)
class ModelPackage:
    """What registration logs: by default (``flavor="pyfunc"``) a models-from-code pyfunc file that imports
    neither ``pipeline`` nor the recipe and the artifacts it loads; or the keyword arguments of another MLflow
    flavor's ``save_model``/``log_model`` (``flavor="transformers"``, ``flavor_args={"transformers_model": ...,
    "task": ...}``). And an input example, from which the signature is inferred."""

    input_example: Any
    python_model: str = ""
    artifacts: dict[str, str] = field(default_factory=dict)
    pip_requirements: list[str] = field(default_factory=list)
    flavor: str = "pyfunc"  # the module mlflow.<flavor> that saves and logs the model
    flavor_args: dict[str, Any] = field(default_factory=dict)

    def log_args(self) -> dict[str, Any]:
        """The flavor's own keyword arguments of ``save_model`` / ``log_model``."""
        if self.flavor == "pyfunc":
            return {"python_model": self.python_model, "artifacts": self.artifacts}
        return dict(self.flavor_args)


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    # build_model(cfg, data) -> nn.Module, built the same on every rank (the loop seeds first).
    build_model: Callable[..., Any] | None = None
    # batch_transform(cfg, data, train) -> picklable callable(columns) -> dict of tensors; train=True augments.
    batch_transform: Callable[..., Callable[[dict[str, Any]], dict[str, Any]]] | None = None
    # loss(cfg, model, batch) -> (loss summed over the batch's samples, {metric: sum over the samples});
    # model.training tells a training step from validation.
    loss: Callable[..., tuple[Any, dict[str, Any]]] | None = None
    # export(model, cfg, data, out_dir) -> {name: file}: rank 0 writes what packaging needs (no pickled classes).
    export: Callable[..., dict[str, str]] | None = None
    # run(cfg, ctx: RunContext, data) -> result fields: a framework trainer's per-rank body instead of the loop;
    # "metrics" (the last validation's), and on rank 0 "model_files" (what export would return) for package.
    run: Callable[..., dict[str, float]] | None = None
    # package(trained result, data, cfg=run config) -> ModelPackage.
    package: Callable[..., ModelPackage] | None = None
    # evaluation_inputs(data, split, cfg=run config) -> (what the registered model takes, what the evaluator
    # scores its output against: label indices, or held-out items).
    evaluation_inputs: Callable[..., tuple[Any, Any]] | None = None
    # The evaluator: metrics with directions, scoring, the report (pipeline.evaluate.classification).
    evaluator: Any = None
    # tokens(batch) -> tokens in the batch, for tokens/s (language models); None counts samples only.
    tokens: Callable[[dict[str, Any]], int] | None = None
    # baseline(cfg, model, data, dist) -> {metric: value} of the untrained model, called on every rank before
    # the first step of a fresh run (not on resume); rank 0's are logged as baseline_<metric> and returned
    # in the result's ``baseline_metrics``.
    baseline: Callable[..., dict[str, float]] | None = None

    def __post_init__(self) -> None:
        loop_hooks = (self.build_model, self.batch_transform, self.loss, self.export)
        if self.run is None and not all(loop_hooks):
            raise TypeError("a TrainSpec needs run, or build_model, batch_transform, loss and export for the loop")
