"""Identity by declaration: every config field says whether it changes what a run makes (``what_field``) or only
how and where the work runs (``where_field``); the digest (checkpoints' resume check, the lineage tag) and the
dataset version hash only the first kind."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import DataConfig, PipelineConfig
from pipeline.config_fields import WHAT, WHERE, identity_of, what_field
from pipeline.data.prepare.publish import content_version
from pipeline.recipes import get_recipe, recipe_names
from pipeline.sweep.study import SweepConfig

# One override per group of "where" fields: each keeps the digest (and so the checkpoints) of a run.
WHERE_GROUPS = {
    "input path": {"data.input_path": "/elsewhere/same-bytes.parquet", "data.format": "parquet"},
    "preparation workers": {"data.workers": 7},
    "batch rows": {"data.batch_rows": 1000},
    "reader": {"data.reader": "ray"},
    "checkpoint location": {"train.checkpoint_uri": "s3://bucket/checkpoints", "train.keep_checkpoints": 9,
                            "train.checkpoint_every_steps": 17},
    "logging": {"train.log_every_steps": 3, "train.metrics_flush_timeout_s": 1.0, "train.peak_tflops": 300.0},
    "loader workers": {"train.num_workers": 3},
    "registry": {"registry.model_name": "other", "registry.experiment": "other"},
    "evaluate": {"evaluate.min_improvement": 0.5, "evaluate.require_approval": True},
    "launch": {"launch.kind": "kubernetes", "launch.nproc_per_node": 8, "launch.max_restarts": 3,
               "launch.kubernetes.namespace": "team-b"},
}
WHAT_CHANGES = {
    "learning rate": {"train.learning_rate": 1e-4},
    "model width": {"model.hidden_sizes": [256, 32]},
    "split seed": {"data.split_seed": 5},
    "epochs": {"train.epochs": 9},
}


def _configs() -> list[type[PipelineConfig]]:
    return [type(get_recipe(name).config()) for name in recipe_names()]


def _walk(identities: dict, prefix: str = ""):
    for name, kind in identities.items():
        if isinstance(kind, dict):
            yield from _walk(kind, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", kind


@pytest.mark.parametrize("cls", _configs() + [SweepConfig], ids=lambda cls: cls.__name__)
def test_every_field_declares_what_or_where(cls):
    declared = dict(_walk(identity_of(cls)))  # raises, naming the field, for one that declares nothing
    assert declared and set(declared.values()) <= {WHAT, WHERE}
    if issubclass(cls, PipelineConfig):
        assert {kind for key, kind in declared.items() if key.startswith("launch.")} == {WHERE}
        assert {kind for key, kind in declared.items() if key.startswith(("registry.", "evaluate."))} == {WHERE}
        assert declared["train.learning_rate"] == declared["data.split_seed"] == WHAT


def test_a_field_that_declares_nothing_is_named():
    @dataclasses.dataclass(kw_only=True)
    class Section:
        declared: int = what_field(1, "A declared field.")
        silent: int = dataclasses.field(default=2)

    with pytest.raises(TypeError, match=r"Section\.silent declares no identity"):
        identity_of(Section)


@pytest.mark.parametrize("group", sorted(WHERE_GROUPS))
def test_a_where_change_keeps_the_digest(group):
    base = get_recipe("tabular_mlp").config("tiny")
    changed = base.with_overrides({k: v for k, v in WHERE_GROUPS[group].items() if v is not None})
    assert changed.to_dict() != base.to_dict()
    assert changed.identity() == base.identity() and changed.digest() == base.digest()


@pytest.mark.parametrize("change", sorted(WHAT_CHANGES))
def test_a_what_change_changes_the_digest(change):
    base = get_recipe("tabular_mlp").config("tiny")
    assert base.with_overrides(WHAT_CHANGES[change]).digest() != base.digest()


def test_the_digest_is_of_the_recipe_too():
    tabular, image = get_recipe("tabular_mlp").config("tiny"), get_recipe("image_classifier").config("tiny")
    assert tabular.identity()["recipe"] == "tabular_mlp" and tabular.digest() != image.digest()


def test_the_dataset_version_follows_the_same_declaration():
    described = [{"relpath": "part-0.parquet", "sha256": "ab" * 32}]
    base = DataConfig(input_path="/data/a.parquet")
    version = content_version(described, base, "parquet", None)
    data_where = {key.split(".", 1)[1]: value for group in WHERE_GROUPS.values() for key, value in group.items()
                  if key.startswith("data.") and value is not None}
    assert content_version(described, dataclasses.replace(base, **data_where), "parquet", None) == version
    for name, value in {"split_seed": 5, "val_fraction": 0.2, "compression": "gz", "unit_bytes": 1 << 10}.items():
        assert content_version(described, dataclasses.replace(base, **{name: value}), "parquet", None) != version, name
