"""What DAG authors use to run code on N ranks: ``TorchrunOperator`` for a module or script, ``@task.torchrun``.

Both go through the same supervised launcher as the pipeline's own train task (``TorchrunJob``):
a guarded process group, live rank-prefixed logs, restarts, a stall watchdog and a clean stop on
``on_kill``, timeouts and SIGTERM. Each job gets a folder keyed by DAG, run and task (not by try
number), exported to the ranks as ``PIPELINE_JOB_DIR`` with ``PIPELINE_CHECKPOINT_DIR`` inside it,
so a script that checkpoints there resumes on an Airflow retry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator

RESULT_FILE = "result.json"


def job_dir(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> Path:
    """The folder of one task's training job, inside the DAG run's working folder: the same on
    every try of that task instance."""
    from pipeline.stages import RunInfo

    folder = RunInfo(dag_id=dag_id, run_id=run_id).workdir / task_id
    return folder / f"map-{map_index}" if map_index >= 0 else folder


class TorchrunOperator(BaseOperator):
    """Run ``torchrun`` over a module (``entry=["-m", "pkg.train", ...]``), a script (``["train.py", ...]``)
    or, with ``no_python=True``, an executable that reads the torchrun environment (Lightning, HF
    Trainer and the CLIs built on them run unchanged).

    Returns the JSON that rank 0 wrote to ``$PIPELINE_RESULT_FILE``, if it wrote one, with the job's
    wall time and folder.
    """

    template_fields: Sequence[str] = ("entry", "env")
    ui_color = "#f3e5d8"

    def __init__(
        self,
        *,
        entry: Sequence[str],
        nproc_per_node: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        rdzv_endpoint: str | None = None,
        max_restarts: int = 0,
        no_python: bool = False,
        env: Mapping[str, str] | None = None,
        stall_timeout_s: float | None = None,
        timeout_s: float = 24 * 3600,
        grace_period_s: float = 10.0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.entry = list(entry)
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.rdzv_endpoint = rdzv_endpoint
        self.max_restarts = max_restarts
        self.no_python = no_python
        self.env = dict(env or {})
        self.stall_timeout_s = stall_timeout_s
        self.timeout_s = timeout_s
        self.grace_period_s = grace_period_s
        self._job = None

    def execute(self, context) -> Any:
        from pipeline.launch.local import TorchrunJob

        ti = context["ti"]
        folder = job_dir(ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1))
        folder.mkdir(parents=True, exist_ok=True)
        result_path = folder / RESULT_FILE
        result_path.unlink(missing_ok=True)  # never report a previous try's result
        env = {
            **self.env, "PIPELINE_JOB_DIR": str(folder), "PIPELINE_CHECKPOINT_DIR": str(folder / "checkpoints"),
            "PIPELINE_RESULT_FILE": str(result_path), "PIPELINE_TRY_NUMBER": str(ti.try_number),
        }
        self._job = TorchrunJob(
            self.entry, nproc_per_node=self.nproc_per_node, nnodes=self.nnodes, node_rank=self.node_rank,
            rdzv_endpoint=self.rdzv_endpoint, max_restarts=self.max_restarts, no_python=self.no_python,
            log_dir=folder / f"logs-try{ti.try_number}", env=env, timeout_s=self.timeout_s,
            grace_period_s=self.grace_period_s, stall_timeout_s=self.stall_timeout_s,
        )
        started = time.perf_counter()
        self._job.run(emit=self.log.info)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        return self._result(result, folder, time.perf_counter() - started)

    def _result(self, result: Any, folder: Path, wall_s: float) -> Any:
        if isinstance(result, dict):
            return {**result, "job_dir": str(folder), "wall_s": round(wall_s, 3)}
        return result

    def on_kill(self) -> None:
        """Airflow calls this when the task is killed (cleared, marked failed, timed out): stop every rank."""
        if self._job is not None:
            self._job.stop()


def torchrun_task(python_callable: Callable | None = None, **kwargs: Any):
    """``@task.torchrun(nproc_per_node=2, ...)``: run the decorated function on every rank under torchrun.

    The function (with its closure, by value) and its arguments are pickled with cloudpickle; the
    process group is initialized before it runs; rank 0's return value becomes the task's XCom.
    Accepts every ``TorchrunOperator`` argument except ``entry``.
    """
    from airflow.sdk.bases.decorator import task_decorator_factory

    return task_decorator_factory(
        python_callable=python_callable, decorated_operator_class=_decorated_operator_class(), **kwargs
    )


_DECORATED: type | None = None


def _decorated_operator_class() -> type:
    # Built on first use: DecoratedOperator pulls in the TaskFlow machinery, which operator users don't need.
    global _DECORATED
    if _DECORATED is None:
        from airflow.sdk.bases.decorator import DecoratedOperator

        class _TorchrunDecoratedOperator(DecoratedOperator, TorchrunOperator):
            custom_operator_name = "@task.torchrun"
            template_fields: Sequence[str] = (*DecoratedOperator.template_fields, "env")

            def __init__(self, *, python_callable: Callable, op_args: Collection[Any] | None = None,
                         op_kwargs: Mapping[str, Any] | None = None, **kwargs: Any):
                super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs,
                                 entry=[], **kwargs)

            def execute(self, context) -> Any:
                from airflow.sdk.definitions.context import context_merge

                context_merge(context, self.op_kwargs)
                kwargs = self.determine_kwargs(context)
                ti = context["ti"]
                folder = job_dir(ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1))
                folder.mkdir(parents=True, exist_ok=True)
                payload, result = folder / "function.pkl", folder / "return_value.pkl"
                payload.write_bytes(_pickle_call(self.python_callable, list(self.op_args), dict(kwargs)))
                result.unlink(missing_ok=True)
                self.entry = ["-m", "pipeline.launch.function", str(payload), str(result)]
                TorchrunOperator.execute(self, context)
                import cloudpickle

                return self._handle_output(cloudpickle.loads(result.read_bytes()))

        _DECORATED = _TorchrunDecoratedOperator
    return _DECORATED


def _pickle_call(function: Callable, args: list, kwargs: dict) -> bytes:
    """cloudpickle the call; the function's module goes by value when the ranks could not import it
    (a DAG file, which Airflow loads under a generated module name)."""
    import importlib.util
    import sys

    import cloudpickle

    module = sys.modules.get(function.__module__)
    if module is not None and function.__module__ != "__main__":
        try:
            importable = importlib.util.find_spec(function.__module__) is not None
        except (ImportError, ValueError):
            importable = False
        if not importable:
            cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps((function, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"@task.torchrun could not pickle {function.__qualname__} and its arguments for the ranks "
            f"({type(exc).__name__}: {exc}); pass plain values (paths, numbers, dicts), not open handles "
            f"or Airflow context objects"
        ) from exc
