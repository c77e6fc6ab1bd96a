"""Launching training: supervised local torchrun jobs, and the operator and decorator DAG authors use.

``from pipeline.launch import TorchrunOperator, torchrun_task``; with the project installed,
``@task.torchrun`` is the same decorator (registered through the ``apache_airflow_provider`` entry
point in ``pyproject.toml``).
"""


def __getattr__(name: str):
    # Lazy: the ranks and the guard import this package too, and must not pay for airflow.sdk.
    if name in ("TorchrunOperator", "torchrun_task", "job_dir"):
        from pipeline.launch import operator

        return getattr(operator, name)
    raise AttributeError(f"module 'pipeline.launch' has no attribute {name!r}")
