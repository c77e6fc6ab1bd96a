"""Stages around a user's own training script (TRL, Accelerate, a CLI trainer) run unchanged by
``TorchrunOperator``: open the MLflow run it logs into, then adopt the model folder it wrote as the
``TrainedModel`` that the shared ``register_model``, ``evaluate`` and ``promote`` stages take."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pipeline import deployment
from pipeline.config import PipelineConfig
from pipeline.errors import UserError
from pipeline.results import PreparedData, TrainedModel
from pipeline.stages.run import RunInfo


class ScriptOutputError(UserError):
    """The script finished but did not leave what registration needs."""


def open_run(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData) -> dict[str, str]:
    """The MLflow run of this DAG run (created once, tagged with its lineage), the environment that makes
    the script's own MLflow integration (the HF Trainer's callback, Accelerate's tracker) log into it, and
    ``train_data``: the dataset's train split as prompt/completion JSON Lines, so that the script never
    sees the rows the evaluation holds out."""
    import json

    from pipeline.data.read.training_data import TrainingData
    from pipeline.registry import tracking
    from pipeline.stages import lineage_tags

    folder = run.job_dir("open_run")
    folder.mkdir(parents=True, exist_ok=True)
    columns = TrainingData.open(list(dataset.uris), folder / "cache").read_split("train")
    if "reference" not in columns:
        raise ScriptOutputError(f"dataset {dataset.version} has no prompt/reference columns: expected a dataset "
                                f"of the {cfg.RECIPE} recipe's tokenization")
    train_data = folder / "train.jsonl"
    tmp = train_data.with_name(".train.jsonl.tmp")
    tmp.write_text("".join(json.dumps({"prompt": str(p), "completion": str(c)}) + "\n"
                           for p, c in zip(columns["prompt"], columns["reference"]) if str(c)))
    tmp.replace(train_data)

    with tracking.reachable("create the MLflow run"):
        run_id = tracking.ensure_run(cfg.registry.experiment, run.key, lineage_tags(cfg, run, dataset))
        tracking.log_dataset_input(run_id, name=cfg.registry.model_name, digest=dataset.version,
                                   source_uri=dataset.uri, profile={"rows": dataset.rows})
    return {"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": deployment.mlflow_tracking_uri(), "train_data": str(train_data)}


def adopt(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData, tracked: dict[str, str],
          script_result: dict[str, Any] | None) -> TrainedModel:
    """The script's result (rank 0's ``$PIPELINE_RESULT_FILE``: ``model_dir``, ``metrics``) as the trained model:
    its model folder is what the recipe's package registers. The script logged its own metrics to MLflow, so
    there is no spill of unsent ones to replay."""
    from pipeline.registry import tracking
    from pipeline.registry.links import run_url

    started = time.perf_counter()
    result = script_result or {}
    # A trainer that writes no result file (a CLI) is expected to save into the job folder's model/.
    model_dir = result.get("model_dir") or (str(Path(result["job_dir"]) / "model") if result.get("job_dir") else None)
    if model_dir and is_adapter(Path(model_dir)):  # LoRA: the adapters folded into their base, as serving loads it
        model_dir = str(merge_adapter(Path(model_dir), run.job_dir("adopt") / "model"))
    if not model_dir or not (Path(model_dir) / "config.json").is_file():
        raise ScriptOutputError(f"the training script's result {result!r} names no model folder with a config.json "
                                f"or a PEFT adapter_config.json (expected 'model_dir' in $PIPELINE_RESULT_FILE, written "
                                f"by rank 0 after save_pretrained, or the model saved in $PIPELINE_JOB_DIR/model)")
    run_id = tracked["MLFLOW_RUN_ID"]
    metrics = {k: float(v) for k, v in (result.get("metrics") or {}).items()}
    experiment_id = tracking.experiment_id_of(run_id)
    named = ("model_dir", "metrics", "world_size", "backend", "wall_s")
    return TrainedModel(
        mlflow_run_id=run_id, mlflow_experiment_id=experiment_id, mlflow_url=run_url(experiment_id, run_id),
        model_files={"model_dir": str(model_dir)}, metrics=metrics,
        world_size=int(result.get("world_size", cfg.launch.nnodes * cfg.launch.nproc_per_node)),
        backend=str(result.get("backend", "script")), dataset_version=dataset.version,
        metrics_path=None,
        wall_s=round(float(result.get("wall_s", 0.0)) + time.perf_counter() - started, 3),
        details={k: v for k, v in result.items() if k not in named},
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def is_adapter(folder: Path) -> bool:
    """A PEFT adapter folder (``adapter_config.json``, no model weights; Axolotl saves the base's ``config.json``
    beside it) rather than a whole model."""
    return (folder / "adapter_config.json").is_file() and not any((folder / name).is_file() for name in MODEL_WEIGHTS)


def merge_adapter(adapter_dir: Path, out_dir: Path) -> Path:
    """The adapter in ``adapter_dir`` merged into its base model (``adapter_config.json``'s
    ``base_model_name_or_path``, a local folder) and saved in ``out_dir`` with the base's tokenizer files (LoRA
    does not change the tokenizer; the adapter's copy, when the base has none): one model folder that
    registration and serving load without PEFT. Written beside ``out_dir`` and renamed into place, so a failed
    merge leaves no half-written folder."""
    import json
    import shutil

    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ScriptOutputError(f"{adapter_dir / 'adapter_config.json'}: base_model_name_or_path={base!r} is not a "
                                f"local model folder with a config.json; expected the model the adapter was trained on")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, local_files_only=True), str(adapter_dir))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.merge_and_unload().save_pretrained(str(tmp), safe_serialization=True)
    for name in TOKENIZER_FILES:
        source = next((d / name for d in (Path(base), adapter_dir) if (d / name).is_file()), None)
        if source is not None:
            shutil.copy(source, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    return out_dir
