"""Everything that imports Airflow, and nothing a rank runs: the DAG factory and script DAGs, the task glue
(``tasks``: run_stage, the train operator, MLflow connection and links, approval), ``TorchrunOperator`` and
``@task.torchrun``, the attempt trigger, the admission policy and the provider metadata.

``from pipeline.airflow import TorchrunOperator, torchrun_task``; with the project installed,
``@task.torchrun`` is the same decorator (registered through the ``apache_airflow_provider`` entry
point in ``pyproject.toml``).
"""


def __getattr__(name: str):
    # Lazy: importing the package for a submodule (the admission policy in the scheduler) needs no operator.
    if name in ("TorchrunOperator", "torchrun_task", "job_dir"):
        from pipeline.airflow import operator

        return getattr(operator, name)
    raise AttributeError(f"module 'pipeline.airflow' has no attribute {name!r}")
