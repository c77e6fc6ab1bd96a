"""Adopting a toolchain script's output (pipeline.stages.script.adopt): a result without a saved model folder
fails as a user error naming what was expected, before anything is registered."""

import pytest

from pipeline.errors import UserError
from pipeline.recipes import get_recipe
from pipeline.results import PreparedData
from pipeline.stages.run import RunInfo
from pipeline.stages.script import ScriptOutputError, adopt


def test_a_script_result_without_a_model_folder_is_a_user_error(tmp_path):
    cfg = get_recipe("llm_sft").config("tiny")
    dataset = PreparedData(name="d", uri="file:///nowhere", version="v1", uris=("file:///nowhere",), versions=("v1",),
                           rows={})
    for result in (None, {"metrics": {"train_loss": 1.0}}, {"model_dir": str(tmp_path)}, {"job_dir": str(tmp_path)}):
        with pytest.raises(ScriptOutputError, match="no model folder with a config.json") as err:
            adopt(cfg, RunInfo("d", "r"), dataset, {"MLFLOW_RUN_ID": "x"}, result)
        assert isinstance(err.value, UserError)  # fails the task without retries
