"""`make demo` on data of the user's (``--conf '{"input_path": ...}'``), for every recipe: the demo's input is neither
written nor read, the run takes the recipe's default variant (the demo variant's settings, such as Fashion-MNIST's
test files, are for the demo's data), and the preparation that the DAG's first task runs accepts the user's input.
Real preparation into MDS shards, in this process and its preparation workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import stages
from pipeline.dev.demo import demo_conf
from pipeline.recipes import get_recipe
from pipeline.stages.run import RunInfo


def _table(folder: Path) -> tuple[Path, dict]:
    from pipeline.data import demo

    return demo.write_parquet(folder / "my_table.parquet", 1_500, seed=7), {}


def _images(folder: Path) -> tuple[Path, dict]:
    from pipeline.data import demo

    demo.write_digits_idx(folder / "my_images", prefix="scans")  # no t10k-* file among them
    return folder / "my_images", {}


def _interactions(folder: Path) -> tuple[Path, dict]:
    from pipeline.recipes.two_tower import RECIPE, synthetic

    path = synthetic.write_interactions(folder / "my_interactions.parquet", users=300, items=400, per_user=8.0)
    # Columns of the user's own: the ones their table has, given as overrides (the default names MovieLens's).
    columns = ("data.categorical_columns", "model.user_features", "model.item_features", "model.history_length")
    return path, {key: RECIPE.variants["tiny"][key] for key in columns}


def _conversations(folder: Path) -> tuple[Path, dict]:
    from pipeline.recipes.llm_sft import demo

    path = demo.write_addition(folder / "my_rows.jsonl", rows=300)
    # Their own tokenizer beside the rows; no column of theirs groups rows (the default's is WordNet's word).
    return path, {"data.tokenizer_path": "tokenizer", "data.key_column": ""}


USER_DATA = {"tabular_mlp": _table, "image_classifier": _images, "two_tower": _interactions,
             "llm_sft": _conversations}


@pytest.mark.parametrize("name", sorted(USER_DATA))
def test_the_demo_on_the_users_data_takes_the_default_variant_and_prepares_it(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
    recipe = get_recipe(name)
    user_input, overrides = USER_DATA[name](tmp_path / "mine")

    conf = demo_conf(recipe, {"input_path": str(user_input), "overrides": overrides})
    assert conf["variant"] == "default" and conf["input_path"] == str(user_input)
    assert not Path(recipe.demo_input_path()).exists()  # the demo's input is not written for nothing

    cfg = recipe.config_from_params(conf)
    assert cfg.data.input_path == str(user_input)
    dataset = stages.prepare_data(cfg, RunInfo(f"{name}_mine", "manual__1"))
    assert all(dataset.rows[split] > 0 for split in ("train", "val", "test")), dataset.rows


def test_the_demo_without_an_input_reads_the_demo_data_with_its_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
    recipe = get_recipe("tabular_mlp")
    conf = demo_conf(recipe, {"epochs": 2})
    assert conf == {"input_path": recipe.demo_input_path(), "variant": "demo", "epochs": 2}
    assert Path(recipe.demo_input_path()).exists()
    # A variant the user names is kept, with the demo's data or their own.
    assert demo_conf(recipe, {"variant": "tiny"})["variant"] == "tiny"
    assert demo_conf(recipe, {"input_path": "/elsewhere/t.parquet", "variant": "tiny"})["variant"] == "tiny"
