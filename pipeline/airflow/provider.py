"""Airflow provider metadata of this package: registers ``@task.torchrun`` with the TaskFlow API."""


def get_provider_info() -> dict:
    return {
        "package-name": "ddp-pipelines",
        "name": "DDP pipelines",
        "description": "Supervised torchrun jobs for Airflow: TorchrunOperator and @task.torchrun.",
        "versions": ["0.1.0"],
        "task-decorators": [{"name": "torchrun", "class-name": "pipeline.airflow.operator.torchrun_task"}],
    }
