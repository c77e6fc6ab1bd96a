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


def test_a_lora_adapter_is_merged_into_its_base_model_before_registration(tmp_path, monkeypatch):
    """A toolchain that saves a PEFT adapter (and, like Axolotl, the base's config.json beside it): adopt folds the
    adapter into the base, and the merged model answers as the adapted one does."""
    import json

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.recipes.llm_sft import demo

    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    additions = demo.write_addition(tmp_path / "additions.jsonl", rows=50)
    base = demo.write_tiny_checkpoint(additions.parent / "tokenizer", tmp_path / "base")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                                 init_lora_weights=False))
    adapter = tmp_path / "job" / "model"
    model.save_pretrained(adapter)
    (adapter / "config.json").write_text((base / "config.json").read_text())  # as Axolotl leaves it
    cfg = get_recipe("llm_sft").config("tiny")
    dataset = PreparedData(name="d", uri="file:///x", version="v1", uris=("file:///x",), versions=("v1",), rows={})
    from pipeline.registry import tracking

    monkeypatch.setattr(tracking, "experiment_id_of", lambda run_id: "0")
    trained = adopt(cfg, RunInfo("d", "r"), dataset, {"MLFLOW_RUN_ID": "x"}, {"job_dir": str(adapter.parent)})

    merged_dir = trained.model_files["model_dir"]
    assert merged_dir == str(RunInfo("d", "r").job_dir("adopt") / "model")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in (tmp_path / merged_dir).iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
    plain = AutoModelForCausalLM.from_pretrained(base)
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted(ids).logits, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, plain(ids).logits, atol=1e-5)  # the adapter did change it

    (adapter / "adapter_config.json").write_text(json.dumps(
        {**json.loads((adapter / "adapter_config.json").read_text()), "base_model_name_or_path": "meta-llama/x"}))
    with pytest.raises(ScriptOutputError, match="base_model_name_or_path='meta-llama/x' is not a local model folder"):
        adopt(cfg, RunInfo("d", "r2"), dataset, {"MLFLOW_RUN_ID": "x"}, {"job_dir": str(adapter.parent)})
