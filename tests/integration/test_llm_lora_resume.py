"""llm_sft with LoRA on real torchrun ranks (2, gloo): checkpoints hold the adapters and the optimizer state, and
a job whose newest checkpoints are gone resumes from the one left to the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.recipes import get_recipe
from pipeline.train.checkpoint import CheckpointStore, load_state
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def job(pipeline_home, tmp_path_factory):
    from pipeline.recipes.llm_sft import demo

    data = demo.write_addition(pipeline_home / "inputs" / "llm_lora" / "additions.jsonl", rows=400)
    cfg = get_recipe("llm_sft").config("tiny").with_overrides({
        "data.input_path": str(data), "model.lora": True, "model.lora_rank": 4, "train.epochs": 2,
        "train.checkpoint_every_steps": 5, "model.eval_max_examples": 8,
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("llm_lora", "prep"))
    config_path = tmp_path_factory.mktemp("llm_lora") / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    return dataset, config_path


def _train(job, out: Path) -> dict:
    dataset, config_path = job
    run_torchrun(["-m", "pipeline.rank", "--recipe", "llm_sft", "--config", str(config_path), "--dataset",
                  dataset.uri, "--out", str(out)], job_dir=out, nproc_per_node=2, emit=lambda line: None,
                 grace_period_s=3)
    return json.loads((out / "result.json").read_text())


def test_lora_checkpoints_hold_adapters_and_optimizer_state_and_a_resumed_job_matches(job, tmp_path):
    out = tmp_path / "job"
    reference = _train(job, out)
    assert reference["start_step"] == 0 and reference["baseline_metrics"]["test_exact_match"] == 0.0
    assert (out / "hf_model" / "model.safetensors").is_file()  # the merged model

    store = CheckpointStore(out / "checkpoints")
    steps = [step for step, _ in store.complete()]
    newest = load_state(store.complete()[0][1])
    assert any("lora_A" in key for key in newest["model"]) and newest["optimizer"]["state"]

    for step, path in store.complete()[:-1]:  # keep only the oldest: the job resumes from it
        shutil.rmtree(path)
    kept = min(steps)
    (out / "result.json").unlink()
    shutil.rmtree(out / "hf_model")
    resumed = _train(job, out)
    assert resumed["start_step"] == kept > 0 and resumed["resumed_from"]
    assert resumed["steps"] == reference["steps"]
    assert resumed["param_digests"] == reference["param_digests"]  # the same parameters as without the break
