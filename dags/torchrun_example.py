"""Running your own code on N ranks: a function with @task.torchrun, a plain DDP script with TorchrunOperator."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import dag, task

from pipeline import deployment
from pipeline.airflow import TorchrunOperator


@dag(
    dag_id="torchrun_example",
    schedule=None,
    catchup=False,
    default_args={"retries": 1, "retry_delay": timedelta(seconds=30)},
    tags=["ddp", "example"],
    doc_md=__doc__,
)
def torchrun_example():
    @task.torchrun(nproc_per_node=2, stall_timeout_s=300)
    def all_reduce(scale: int) -> dict:
        # Runs on every rank with the process group already up; rank 0's return value is the XCom.
        import torch
        import torch.distributed as dist

        value = torch.tensor([float(dist.get_rank() + 1) * scale])
        dist.all_reduce(value)
        return {"world_size": dist.get_world_size(), "sum": value.item()}

    script = TorchrunOperator(
        task_id="ddp_script",
        entry=[str(deployment.PROJECT_ROOT / "examples" / "ddp_regression.py"), "--steps", "200"],
        nproc_per_node=2,
    )
    all_reduce(scale=10) >> script


torchrun_example()
