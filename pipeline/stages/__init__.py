"""The pipeline's stages, one module each; each DAG task is one call to one of their functions:
``preparation`` (prepare_data, prepare_interval), ``training`` (train_job and trained_model, around the job's
run), ``registration`` (register_model), ``evaluation`` (evaluate), ``promotion`` (promote), ``sweep`` (a sweep's plan,
trials and best trial, around the train stage); ``lineage`` (what
ties a model to what made it), ``run`` (which DAG run a stage works for) and ``script`` (the stages around a
user's own training script).

They take and return the typed results of ``pipeline.results``; ``pipeline.airflow.tasks.run_stage`` converts
them from and to XCom by these functions' annotations. Light at import (the DAG processor imports this
package): torch, mlflow, pyarrow and streaming are imported inside the functions that need them.
"""

from __future__ import annotations

from pipeline.stages.evaluation import evaluate
from pipeline.stages.lineage import lineage_tags
from pipeline.stages.preparation import prepare_data, prepare_interval
from pipeline.stages.promotion import promote
from pipeline.stages.registration import register_model
from pipeline.stages.run import RunInfo
from pipeline.stages.training import train_job, trained_model

__all__ = ["RunInfo", "prepare_data", "prepare_interval", "train_job", "trained_model", "register_model",
           "evaluate", "promote", "lineage_tags"]
