"""Unsloth, Axolotl and LLM Foundry run for real under the launcher, each in its own environment, from script DAGs
like the TRL and Accelerate ones: LoRA fine-tuning of a tiny local Llama-architecture checkpoint on 2 CPU ranks,
the adapter merged, registered (mlflow.transformers), evaluated and gated; the toolchain's own MLflow logging in
the DAG's run; an Airflow retry that resumes from the toolchain's own checkpoint; a config mistake that fails at
once. ``pytest -m toolchains``; a toolchain whose environment is not built (``make toolchain NAME=...``) is skipped,
with that command in the reason."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from pipeline import deployment, toolchains
from pipeline.dev.demo import run_dag
from pipeline.stages.run import RunInfo

pytestmark = [pytest.mark.toolchains, pytest.mark.e2e]


# toolchain -> its DAG, a file that exists once the first checkpoint is complete (job folder relative), the name of
# a training-loss metric its own MLflow logging writes, and a config mistake with what the error must name.
CASES = {
    "unsloth": ("unsloth_sft_example", "checkpoints/checkpoint-*/trainer_state.json", "loss",
                "sft:\n  max_stepz: 3\n", "max_stepz"),
    "axolotl": ("axolotl_sft_example", "model/checkpoint-*/trainer_state.json", "loss",
                "micro_batch_size: many\n", "micro_batch_size"),
    "llm_foundry": ("llm_foundry_example", "checkpoints/latest-rank0.pt", "loss/train/total",
                    "max_seq_lenn: 32\n", "max_seq_lenn"),
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Nothing comes from a hub: the toolchains' ranks run with the Hugging Face hub offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PIPELINE_RETRY_DELAY_S", "1")


def _built(name: str) -> toolchains.Toolchain:
    toolchain = toolchains.get(name)
    if toolchain.built() is None:
        pytest.skip(f"the {name} toolchain's environment is not built: make toolchain NAME={name}")
    return toolchain


@pytest.fixture(scope="module")
def base_model(pipeline_home):
    """The llm_sft demo's additions and a tiny, untrained Llama-architecture checkpoint with its tokenizer."""
    from pipeline.recipes.llm_sft import demo

    additions = demo.write_addition(pipeline_home / "inputs" / "toolchains" / "additions.jsonl", rows=1200)
    return additions, demo.write_tiny_checkpoint(additions.parent / "tokenizer", pipeline_home / "inputs" / "tiny-llama")


def _conf(base_model, **extra):
    additions, checkpoint = base_model
    return {"input_path": str(additions), "variant": "tiny", "pretrained_path": str(checkpoint),
            "tokenizer_path": str(checkpoint), "overrides": {"data.response_column": "response"}, **extra}


def _kill_the_first_attempt_after(runs, pattern: str, killed: dict) -> None:
    """Once the first attempt's first checkpoint is complete: SIGKILL its guard, torchrun agent and ranks (a lost
    node), so that the task fails and Airflow retries it."""
    before = set(runs.glob("*")) if runs.exists() else set()
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and not killed:
        for workdir in set(runs.glob("*")) - before:
            if list((workdir / "train").glob(pattern)):
                guards = [p for p in psutil.process_iter(["cmdline"])
                          if "pipeline.job.local.process_group" in (p.info["cmdline"] or [])
                          and any(str(workdir) in arg for arg in p.info["cmdline"])]
                for guard in guards:
                    tree = [guard, *guard.children(recursive=True)]
                    killed["pids"], killed["at_ms"] = [p.pid for p in tree], time.time() * 1000
                    for process in tree:
                        try:
                            process.send_signal(signal.SIGKILL)
                        except psutil.NoSuchProcess:
                            pass
                if killed:
                    return
        time.sleep(0.05)


def _why(dag_id: str, run_id: str) -> str:
    """What a failed run's train job left: the errors its ranks reported, its attempts and the end of each log."""
    job = RunInfo(dag_id, run_id).workdir / "train"
    parts = [f"{p.relative_to(job)}: {p.read_text()[-2000:]}"
             for p in [*sorted(job.glob("errors/*.json")), *job.glob("attempts.jsonl")]]
    parts += [f"{p.relative_to(job)} (end): {p.read_text(errors='replace')[-3000:]}" for p in sorted(job.rglob("*.log"))]
    return f"the run failed; its train job folder {job}:\n" + "\n".join(parts or ["(nothing)"])


@pytest.mark.parametrize("name", list(CASES))
def test_a_toolchain_trains_is_retried_from_its_own_checkpoint_and_its_model_is_registered_and_gated(
        airflow_db, base_model, name):
    from pipeline.registry.tracking import client

    _built(name)
    dag_id, checkpoint, loss_metric, _, _ = CASES[name]
    killed: dict = {}
    watcher = threading.Thread(target=_kill_the_first_attempt_after,
                               args=(deployment.runs_dir() / dag_id, checkpoint, killed), daemon=True)
    watcher.start()
    dag_run = run_dag(dag_id, _conf(base_model))
    watcher.join(timeout=5)
    assert killed, "the first attempt was never killed"
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success", _why(dag_id, dag_run.run_id)
    tries = {ti.task_id: ti.try_number for ti in dag_run.get_task_instances()}
    assert tries["train"] == 2  # the retry, not a restart inside the first try

    workdir = RunInfo(dag_id, dag_run.run_id).workdir
    result = json.loads((workdir / "train" / "result.json").read_text())
    print(f"{name}: resumed from {result['resumed_from']}, {result['steps']} steps, {result['world_size']} ranks")
    assert result["resumed_from"] and result["world_size"] == 2 and result["steps"] >= 10
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["model"]["name"] == dag_id and summary["train"]["world_size"] == 2
    assert set(summary["test_metrics"]) >= {"loss", "perplexity", "exact_match"}
    assert summary["promoted"], summary["reason"]

    # The toolchain's own MLflow logging went into the DAG's run; the retry's steps start at the checkpoint it
    # resumed from (without the resume, it would log from step 0 or 1 again). Composer sends its metrics to MLflow
    # in the background, so the killed try may have sent none.
    resumed_at = int(re.search(r"(?:checkpoint-|-ba)(\d+)", Path(result["resumed_from"]).name).group(1))
    history = client().get_metric_history(summary["model"]["mlflow_run_id"], loss_metric)
    retry = [m.step for m in history if m.timestamp > killed["at_ms"]]
    assert retry and max(retry) >= 10, retry
    assert min(retry) >= resumed_at > 1, f"the retry logged step {min(retry)}, before checkpoint {resumed_at}"


@pytest.mark.parametrize("name", list(CASES))
def test_a_mistake_in_the_toolchains_config_fails_the_task_at_once_without_a_retry(
        airflow_db, base_model, tmp_path, name):
    toolchain = _built(name)
    dag_id, _, _, mistake, named = CASES[name]
    config = tmp_path / "bad.yaml"  # the toolchain's own config with one mistake added
    config.write_text((toolchain.folder / "sft.yaml").read_text() + mistake)
    dag_file = tmp_path / f"{name}_bad_config.py"
    bad_id = f"{name}_bad_config"
    source = (deployment.PROJECT_ROOT / "dags" / f"{dag_id}.py").read_text()
    assert f'"{dag_id}",' in source
    dag_file.write_text(source.replace(f'"{dag_id}",', f'"{bad_id}",', 1).replace(
        '"--data", TRAIN_DATA', f'"--data", TRAIN_DATA, "--config", {str(config)!r}', 1))
    dag_run = run_dag(bad_id, _conf(base_model), dag_file=dag_file)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "failed"
    train = next(ti for ti in dag_run.get_task_instances() if ti.task_id == "train")
    assert str(getattr(train.state, "value", train.state)) == "failed" and train.try_number == 1
    errors = sorted((RunInfo(bad_id, dag_run.run_id).workdir / "train" / "errors").glob("rank-*.json"))
    reported = json.loads(errors[0].read_text())
    assert reported["type"] == "ConfigError" and named in reported["message"], reported
    assert any(reported["message"].startswith(kind) for kind in toolchain.config_errors), reported
