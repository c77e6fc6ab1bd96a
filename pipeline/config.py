"""Typed pipeline configs: one serialized form for Airflow Params, the torchrun CLI and MLflow.

Each section is a keyword-only dataclass; a field's ``metadata`` documents it and states what is
allowed (``min``/``max``/``choices``). The same metadata validates values and builds the Params form,
so the form, the CLI and the code cannot disagree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pipeline.config_fields import WHAT, build, flatten, identity_of, only, param_schema, what_field, where_field
from pipeline.errors import ConfigError
from pipeline.launch_config import LaunchConfig


@dataclass(kw_only=True)
class DataConfig:
    input_path: str = where_field(
        "", "Input rows: a file, a folder (hive partitions such as dt=2026-11-29/ included) or an fsspec URI "
        "(file://, s3://, ...) of Parquet, CSV, JSON Lines, IDX image/label files or class-folders of images."
    )
    format: str = where_field(
        "auto", "Input format; auto decides from the file names.",
        choices=["auto", "parquet", "csv", "jsonl", "idx", "image_folder"],
    )
    columns: list[str] = what_field([], "Columns the input must have, no more and no fewer; empty takes the first file's.")
    label_column: str = what_field(
        "label", "Column holding the class label (integers or strings); empty for data without labels "
        "(interactions, text).")
    categorical_columns: list[str] = what_field(
        [], "Feature columns to encode with a vocabulary; empty means every string column."
    )
    key_column: str = what_field("", "Column whose hash assigns rows to splits; empty uses row position.")
    split_by: str = what_field(
        "hash", "How rows go to train/val/test. hash: by a hash of key_column (or the row position), in the "
        "fractions below; time: the newest val_fraction and test_fraction of rows by time_column, from cut-offs "
        "over the whole input; last_per_group: each group_column value's newest test_per_group rows by "
        "time_column go to test and the val_per_group before them to val; files: the rows of the files "
        "test_files names are test (a data set's own), the rest train and val by the hash.",
        choices=["hash", "time", "last_per_group", "files"])
    test_files: list[str] = what_field([], "split_by=files: shell patterns (t10k-*, test/*) of the input files "
                                       "that hold the test split, matched to each path under input_path and name.")
    time_column: str = what_field("", "Numeric column of event times (e.g. epoch seconds) that time splits order rows by.")
    group_column: str = what_field("", "Column whose values (e.g. users) last_per_group holds out the newest rows of.")
    val_per_group: int = what_field(1, "last_per_group: each group's rows held out for validation.", min=0, max=1000)
    test_per_group: int = what_field(1, "last_per_group: each group's newest rows held out for test.", min=1, max=1000)
    val_fraction: float = what_field(0.1, "Fraction of rows in the validation split.", min=0.0, max=0.5)
    test_fraction: float = what_field(0.1, "Fraction of rows in the test split.", min=0.01, max=0.5)
    split_seed: int = what_field(0, "Salt of the split hash; change it to draw other splits.", min=0)
    shard_size_limit_bytes: int = what_field(1 << 26, "Largest MDS shard before compression.", min=1 << 10,
                                             max=1 << 32)
    compression: str = what_field("zstd", "MDS shard compression.", choices=["zstd", "gz", "bz2", "none"])
    batch_rows: int = where_field(65_536, "Rows per Arrow record batch read from the input.", min=1)
    column_encodings: list[str] = what_field(
        [], "MDS encodings that replace the inferred ones, as COLUMN:ENCODING (x0:float32, image:png); "
        "pickle is refused."
    )
    label_classes: list[str] = what_field(
        [], "The label's allowed classes; a row with another label is bad. Empty takes the classes found."
    )
    on_bad_rows: str = what_field(
        "fail", "fail: the first bad row fails the run, naming file, row, column and value; quarantine: bad "
        "rows go to quarantine.parquet beside the dataset.", choices=["fail", "quarantine"],
    )
    max_bad_fraction: float = where_field(
        0.01, "With quarantine, the run fails when more than this fraction of rows is bad.", min=0.0, max=1.0
    )
    reader: str = where_field(
        "mds", "What feeds the training split to the ranks: mds reads the published shards in each rank "
        "(resumes mid-epoch at the exact sample); ray streams them through Ray Data (launch.kind=ray only).",
        choices=["mds", "ray"])
    workers: int = where_field(2, "Processes converting input units in parallel, the preparing one included.", min=1, max=256)
    unit_bytes: int = what_field(
        16 << 20, "Uncompressed input bytes per work unit (whole Parquet row groups, IDX rows, image files; "
        "a CSV or JSON Lines file is one unit). Workers share out units; the output depends on this, not on "
        "the worker count.", min=1,
    )
    partition_key: str = where_field("dt", "Hive partition key (folders KEY=DATE) that a DAG run's data interval selects.")
    window_intervals: int = where_field(3, "Intervals of daily datasets an asset-triggered training run reads, "
                                        "newest last.", min=1, max=366)
    transform: str = what_field(
        "", "Row transform run by the preparation after validation (module:ATTR of a factory taking this data "
        "config, see pipeline.data.prepare.transform), e.g. a recipe's tokenization; empty stores the validated rows."
    )


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = what_field(5, "Passes over the training split.", min=1, max=1000)
    batch_size: int = what_field(256, "Samples per step on each rank.", min=1, max=65_536)
    learning_rate: float = what_field(3e-3, "AdamW learning rate.", min=1e-7, max=1.0)
    weight_decay: float = what_field(1e-4, "AdamW weight decay.", min=0.0, max=1.0)
    seed: int = what_field(0, "Random seed; rank r seeds with seed + r.", min=0)
    log_every_steps: int = where_field(50, "Steps between progress lines in the log (and step metrics in MLflow).", min=1)
    metrics_flush_timeout_s: float = where_field(
        120.0, "How long the train task keeps sending rank 0's metrics to MLflow after training; what is "
        "still unsent then, register_model sends.", min=0.0,
    )
    grad_accum_steps: int = what_field(
        1, "Micro-batches per optimizer step (gradients accumulated; DDP syncs only on the last).", min=1, max=1024,
    )
    lr_schedule: str = what_field("constant", "Learning-rate schedule after warm-up.", choices=["constant", "cosine"])
    warmup_steps: int = what_field(0, "Optimizer steps of linear learning-rate warm-up.", min=0)
    precision: str = what_field(
        "auto", "Math precision; auto is bf16 autocast on a GPU that supports it, fp32 otherwise.",
        choices=["auto", "fp32", "bf16"],
    )
    num_workers: int = where_field(0, "Data loader worker processes per rank.", min=0, max=64)
    peak_tflops: float = where_field(
        0.0, "Peak dense TFLOP/s of one device at the training precision, for MFU; 0: the GPU's bf16 peak from the "
        "table of common ones (pipeline.train.throughput), and no MFU on a CPU or an unknown device.", min=0.0)
    checkpoint_every_steps: int = where_field(
        200, "Optimizer steps between checkpoints (one is also written at every epoch end); 0 writes only those.",
        min=0,
    )
    keep_checkpoints: int = where_field(3, "Complete checkpoints kept; older ones are deleted.", min=1, max=100)
    checkpoint_uri: str = where_field(
        "", "Where checkpoints are kept: empty for the job folder's checkpoints/, or a folder or object-store prefix "
        "(s3://bucket/prefix) under which each job has its own (its job folder's path under the runs folder). On an "
        "object store they are written on the node first, uploaded with the marker last, and downloaded to resume.")
    parallelism: str = what_field(
        "ddp", "How the ranks hold the model: ddp keeps a whole replica (parameters, gradients, optimizer state) on "
        "every rank; fsdp shards all three over the ranks (FSDP2, one unit per block of the recipe), for models "
        "that do not fit one device. Its checkpoints are sharded and resume on any number of ranks.",
        choices=["ddp", "fsdp"],
    )
    reshard_after_forward: bool = where_field(
        True, "fsdp: free each block's gathered parameters after its forward and gather them again for the "
        "backward (less memory, one more all-gather per block).",
    )
    cpu_offload: bool = where_field(
        False, "fsdp: keep the sharded parameters, gradients and optimizer state in host memory, copied to the GPU "
        "block by block (a GPU only: on a CPU they are in host memory already).",
    )
    activation_checkpointing: bool = what_field(
        False, "Keep only each block's inputs in the forward and recompute its activations in the backward (less "
        "memory, about a third more compute); ddp or fsdp.",
    )

    def __post_init__(self) -> None:
        if self.cpu_offload and self.parallelism != "fsdp":
            raise ConfigError(f"train.cpu_offload=true: it offloads the shards of train.parallelism='fsdp'; this "
                              f"config has train.parallelism={self.parallelism!r}")


@dataclass(kw_only=True)
class RegistryConfig:
    model_name: str = where_field("tabular_mlp", "Registered model name in MLflow.")
    experiment: str = where_field("tabular_mlp", "MLflow experiment of the training runs.")


@dataclass(kw_only=True)
class EvaluateConfig:
    metric: str = where_field(
        "accuracy", "Primary metric that decides promotion; one of the recipe's metrics, whose directions are known "
        "(log_loss is lower-better).",
    )
    min_improvement: float = where_field(
        -0.01, "Least gain over the champion on the primary metric; negative tolerates that much regression.",
        min=-1.0, max=1.0,
    )
    guardrails: list[str] = where_field(["macro_f1"], "Metrics that must not regress beyond guardrail_tolerance; the recipe's metrics.")
    guardrail_tolerance: float = where_field(0.02, "Largest allowed regression of a guardrail metric.", min=0.0, max=1.0)
    require_approval: bool = where_field(
        False, "Ask a person (Airflow human-in-the-loop) before moving the champion; no answer in 24 h rejects.",
    )


@dataclass(kw_only=True)
class ModelConfig:
    """A recipe's ``model`` section: each recipe subclasses it with its own fields."""


@dataclass(kw_only=True)
class PipelineConfig:
    """The whole config of one recipe's run. A recipe subclasses it to give ``model`` its own type and
    ``METRICS`` its metrics (name -> higher is better), which the gate's ``evaluate.*`` names must use."""

    METRICS: ClassVar[dict[str, bool]] = {}
    RECIPE: ClassVar[str] = ""  # the registered recipe this config is of (pipeline.recipes)
    SHARDS: ClassVar[bool] = True  # whether the recipe's model trains under train.parallelism = fsdp

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)

    def __post_init__(self) -> None:
        if self.train.parallelism == "fsdp" and not self.SHARDS:
            raise ConfigError(f"train.parallelism='fsdp': the {self.RECIPE} recipe trains with its own loop, which "
                              f"keeps a whole model on every rank; expected train.parallelism='ddp'")
        if not self.METRICS:
            return
        for name, value in [("evaluate.metric", self.evaluate.metric)] + [
                (f"evaluate.guardrails[{i}]", g) for i, g in enumerate(self.evaluate.guardrails)]:
            if value not in self.METRICS:
                raise ConfigError(f"{name}={value!r}: expected one of this recipe's metrics {sorted(self.METRICS)}")

    def to_dict(self) -> dict[str, Any]:
        """The one serialized form, ``launch`` included (Params, overrides), carrying its recipe's name."""
        return ({"recipe": self.RECIPE} if self.RECIPE else {}) | dataclasses.asdict(self)

    def settings(self) -> dict[str, Any]:
        """``to_dict`` less ``launch``: what the ranks' config file and the MLflow params hold."""
        return {key: value for key, value in self.to_dict().items() if key != "launch"}

    def identity(self) -> dict[str, Any]:
        """What is made, apart from how and where: only the fields declared ``what_field`` (``launch`` has none).
        The digest is made of it, so a run given another input path of the same content, other workers, another
        checkpoint location, logging, registry, gate or place keeps its digest, its lineage and its checkpoints."""
        return {"recipe": self.RECIPE} | only(dataclasses.asdict(self), identity_of(type(self)), WHAT)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PipelineConfig:
        raw = dict(raw)
        recipe = raw.pop("recipe", cls.RECIPE)
        if recipe != cls.RECIPE:
            raise ConfigError(f"recipe={recipe!r}: this is a config of the {cls.RECIPE or 'generic'} recipe")
        return build(cls, raw, prefix="")

    def with_overrides(self, overrides: dict[str, Any]) -> PipelineConfig:
        """A copy with dotted keys (``{"train.learning_rate": 3e-4, "model.depth": 2}``) replaced, validated."""
        merged = self.to_dict()
        for dotted, value in overrides.items():
            *path, name = dotted.split(".")
            node, where = merged, []
            for part in path:
                if not isinstance(node.get(part), dict):
                    break
                node, where = node[part], where + [part]
            else:
                if name in node and not isinstance(node[name], dict):
                    node[name] = value
                    continue
            prefix = ".".join(where)
            fields = sorted(f"{prefix}.{k}" if prefix else k for k in node)
            raise ConfigError(f"unknown config key {dotted!r}: the keys that exist here are {fields}")
        return type(self).from_dict(merged)

    def digest(self) -> str:
        """Short content hash of what is trained (``identity``), for lineage tags and checkpoints."""
        blob = json.dumps(self.identity(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def flat(self) -> dict[str, Any]:
        """Every field as a dotted key (``model.depth``), ``launch`` included: what the Params form maps to."""
        return flatten(self.to_dict())

    def as_params(self) -> dict[str, str]:
        """``settings`` as MLflow params: dotted keys, text as is, other values as JSON (``from_flat`` reads them)."""
        return {key: value if isinstance(value, str) else json.dumps(value)
                for key, value in flatten(self.settings()).items()}

    @classmethod
    def from_flat(cls, params: dict[str, str]) -> PipelineConfig:
        """The config back from MLflow params (dotted keys, values as text: ``as_params``), ``launch`` at its defaults."""
        defaults = cls().flat()
        overrides = {}
        for key, text in params.items():
            if key not in defaults:
                continue  # params that are no config field (launch.world_size, of older runs)
            try:
                value = json.loads(text)
            except (TypeError, json.JSONDecodeError):
                value = text
            overrides[key] = text if isinstance(defaults[key], str) else value
        return cls().with_overrides(overrides)

    @classmethod
    def field_rules(cls, dotted: str) -> tuple[Any, dict[str, Any]]:
        """The type and metadata (help, min, max, choices) of a dotted config field."""
        owner: Any = cls
        *path, name = dotted.split(".")
        for part in path:
            owner = typing.get_type_hints(owner)[part]
        meta = dict({f.name: f.metadata for f in dataclasses.fields(owner)}[name])
        if dotted in ("evaluate.metric", "evaluate.guardrails") and cls.METRICS:
            meta["choices"] = sorted(cls.METRICS)
        return typing.get_type_hints(owner)[name], meta

    @classmethod
    def param_schema(cls, dotted: str, default: Any) -> dict[str, Any]:
        """JSON-schema keywords for an Airflow ``Param`` mirroring a config field's rules."""
        hint, rules = cls.field_rules(dotted)
        return param_schema(hint, rules, default)
