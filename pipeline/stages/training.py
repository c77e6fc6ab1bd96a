"""The train stage in its two halves, around the job's run (``pipeline.job.supervisor.Job``) or its deferral:
``train_job`` makes the run's training job, ``trained_model`` reads its end. The recipe DAGs' train task
(``pipeline.airflow.tasks.TrainOperator``) calls both, and so do the tests and benchmarks that train outside
Airflow."""

from __future__ import annotations

import json
from typing import Any

from pipeline import deployment
from pipeline.config import PipelineConfig
from pipeline.results import PreparedData, TrainedModel
from pipeline.stages.lineage import lineage_tags
from pipeline.stages.run import RunInfo


def train_job(cfg: PipelineConfig, run: RunInfo, dataset: PreparedData, *, map_index: int = -1,
              key: str | None = None, tags: dict[str, str] | None = None):
    """The run's training job (``JobSpec``): its MLflow run created once, tagged with the lineage and given
    what is trained as params, and what is trained written into the job folder, where the ranks read it.
    Where the job runs reaches the place through the ``JobSpec``, not the ranks' config file.

    A sweep's trial is one of several jobs of its DAG run: its mapped task's ``map_index`` keys its job folder,
    ``key`` its MLflow run (default: the DAG run's), and ``tags`` add to the run's."""
    from pipeline.job.spec import JobSpec
    from pipeline.registry import tracking
    from pipeline.registry.links import run_url

    with tracking.reachable("create the MLflow run"):
        # The ranks asked for say where the run went, not what it trained: a tag of this run, outside the lineage.
        ranks = {"launch.world_size": str(cfg.launch.nnodes * cfg.launch.nproc_per_node)}
        mlflow_run_id = tracking.ensure_run(cfg.registry.experiment, key or run.key,
                                            lineage_tags(cfg, run, dataset) | ranks | (tags or {}))
        experiment_id = tracking.experiment_id(cfg.registry.experiment)
        tracking.log_params_once(mlflow_run_id, cfg.as_params())
        tracking.log_dataset_input(
            mlflow_run_id, name=cfg.registry.model_name, digest=dataset.version, source_uri=dataset.uri,
            profile={"rows": dataset.rows},
        )
    # Keyed by DAG, run and task, not by try: a retry resumes from the checkpoints the last try left.
    folder = run.job_dir("train", map_index)
    spec = JobSpec(
        entry=["-m", "pipeline.rank", "--config", str(folder / "config.json"),
               *(arg for uri in dataset.uris for arg in ("--dataset", uri))],
        job_dir=folder, launch=cfg.launch,
        name=f"{run.dag_id}-train-" + (f"{map_index}-" if map_index >= 0 else "") + str(run.try_number),
        try_number=run.try_number, labels={"dag_id": run.dag_id, "run_id": run.run_id, "task_id": "train",
                                           "try_number": str(run.try_number)},
        # The run's id tells the task's metrics relay where rank 0's metrics go (pipeline.registry.metrics_relay).
        env={"MLFLOW_RUN_ID": mlflow_run_id, "MLFLOW_TRACKING_URI": deployment.mlflow_tracking_uri()},
    )
    spec.files.root.mkdir(parents=True, exist_ok=True)
    spec.files.config.write_text(json.dumps(cfg.settings(), indent=2))
    spec.files.tracking.write_text(json.dumps({"run_id": mlflow_run_id, "experiment_id": experiment_id,
                                               "url": run_url(experiment_id, mlflow_run_id)}))
    return spec


def trained_model(spec, result: dict[str, Any] | None, wall_s: float) -> TrainedModel:
    """The job's end as a ``TrainedModel``: rank 0's result file and the MLflow run's address."""
    from pipeline.job.supervisor import run_figures, run_tags
    from pipeline.registry import tracking
    from pipeline.registry.links import run_url

    if result is None:
        raise RuntimeError(f"training ended without writing {spec.files.result}")
    mlflow_run_id = spec.env["MLFLOW_RUN_ID"]
    experiment_id = tracking.experiment_id_of(mlflow_run_id)
    # Every rank's figures, the stragglers and every attempt's cost, as the job folder recorded them.
    figures = run_figures(spec.files)
    if tags := run_tags(figures):
        tracking.set_tags(mlflow_run_id, tags)
    if figures.get("cost"):
        tracking.log_metrics_now(mlflow_run_id, {f"run_{key}": figures["cost"][key]
                                                 for key in ("gpu_hours", "node_hours", "cost")})
    # Rank 0's result file: the contract's fields, and the rest (steps, resumed_from, throughput) as details.
    named = ("model_files", "metrics", "world_size", "backend", "dataset_version", "samples_per_s",
             "baseline_metrics")
    return TrainedModel.from_xcom({key: result[key] for key in named if key in result} | {
        "mlflow_run_id": mlflow_run_id, "mlflow_experiment_id": experiment_id, "metrics_path": str(spec.files.metrics),
        "mlflow_url": run_url(experiment_id, mlflow_run_id), "wall_s": round(wall_s, 3),
        "details": {k: v for k, v in result.items() if k not in named and k != "mlflow_run_id"} | figures,
    })
