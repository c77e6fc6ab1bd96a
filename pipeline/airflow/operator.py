"""What DAG authors use to run code on N ranks: ``TorchrunOperator`` for a module or script, ``@task.torchrun``.

Both go through the same supervisor as the pipeline's own train task
(``pipeline.job.supervisor.Job``, ``launch.kind`` picks where): live rank-prefixed logs, restarts, a stall
watchdog, user errors that fail without retries, and a clean stop on ``on_kill``, timeouts and SIGTERM. Each job gets a folder keyed by DAG, run and task (not by try
number), exported to the ranks as ``PIPELINE_JOB_DIR`` with ``PIPELINE_CHECKPOINT_DIR`` inside it,
so a script that checkpoints there resumes on an Airflow retry.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator

from pipeline.job.supervisor import METRICS_FLUSH_TIMEOUT_S


def job_dir(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> Path:
    """The folder of one task's training job, inside the DAG run's working folder: the same on
    every try of that task instance."""
    from pipeline.stages.run import RunInfo

    return RunInfo(dag_id=dag_id, run_id=run_id).job_dir(task_id, map_index)


class TorchrunOperator(BaseOperator):
    """Run ``torchrun`` over a module (``entry=["-m", "pkg.train", ...]``), a script (``["train.py", ...]``)
    or, with ``no_python=True``, an executable that reads the torchrun environment (Lightning, HF
    Trainer and the CLIs built on them run unchanged). ``toolchain="axolotl"`` runs the agent and the ranks
    in that toolchain's own environment (``pipeline.toolchains``; its image on Kubernetes). The entry's
    arguments may name the job's folders: ``${PIPELINE_JOB_DIR}``, ``${PIPELINE_CHECKPOINT_DIR}``.

    Where and how it runs are the ``launch.*`` config fields, as keyword arguments (``nproc_per_node``,
    ``nnodes``, ``max_restarts``, ``stall_timeout_s``, ``timeout_s``, ``grace_period_s``, ``kind``, ...),
    validated by the same rules. Returns the JSON that rank 0 wrote to ``$PIPELINE_RESULT_FILE``, if
    it wrote one, with the job's wall time and folder. A ``UserError`` raised in a rank (reported by
    ``pipeline.job_files.user_errors_reported``) fails the task without retries.
    """

    template_fields: Sequence[str] = ("entry", "env")
    ui_color = "#f3e5d8"
    # How long the task keeps sending rank 0's metrics file to MLflow after the job (pipeline.registry.metrics_relay).
    metrics_flush_timeout_s = METRICS_FLUSH_TIMEOUT_S

    def __init__(self, *, entry: Sequence[str], no_python: bool = False, env: Mapping[str, str] | None = None,
                 toolchain: str | None = None, **kwargs: Any):
        from dataclasses import fields

        from pipeline.launch_config import LaunchConfig
        from pipeline.job.spec import launch_config

        names = {f.name for f in fields(LaunchConfig)}
        self.launch = launch_config({k: kwargs.pop(k) for k in list(kwargs) if k in names})
        super().__init__(**kwargs)
        self.entry = list(entry)
        self.no_python = no_python
        self.toolchain = toolchain
        self.env = dict(env or {})
        self._job = None

    def _spec(self, context):
        from pipeline.job.spec import JobSpec, resolve
        from pipeline.job_files import JobFiles

        ti = context["ti"]
        map_index = getattr(ti, "map_index", -1)
        folder = job_dir(ti.dag_id, ti.run_id, ti.task_id, map_index)
        return resolve(JobSpec(entry=[JobFiles(folder).expand(arg) for arg in self.entry], job_dir=folder, launch=self.launch,
                       no_python=self.no_python, toolchain=self.toolchain, env=self.env,
                       name=f"{ti.dag_id}-{ti.task_id}-{ti.try_number}", try_number=ti.try_number,
                       labels={"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id,
                               "map_index": str(map_index), "try_number": str(ti.try_number)}))

    def execute(self, context) -> Any:
        started = time.time()
        with user_errors_fail():
            spec = self._spec(context)
            if spec.launch.deferrable:
                from pipeline.airflow.deferred import start as defer_attempt

                defer_attempt(self, spec, restart=0, started=started)
            from pipeline.airflow.connections import AirflowClusters
            from pipeline.job.supervisor import Job
            from pipeline.registry import tracking_server

            with tracking_server.for_ranks(spec) as spec:
                self._job = Job(spec, clusters=AirflowClusters(), metrics_flush_timeout_s=self.metrics_flush_timeout_s,
                                pruner=self._pruner(spec))
                result = self._job.run(emit=self.log.info)
            return self._result(context, spec, result, time.time() - started)

    def execute_complete(self, context, event: dict[str, Any], restart: int, started: float) -> Any:
        """Back from the triggerer (``launch.<kind>.deferrable``): tear the attempt down, then rank 0's
        result, a user error without retries, a replacement attempt within ``max_restarts``, or the failure."""
        from pipeline.airflow.deferred import complete as complete_attempt

        with user_errors_fail():
            spec = self._spec(context)
            result = complete_attempt(self, spec, event, restart=restart, started=started,
                                      metrics_flush_timeout_s=self.metrics_flush_timeout_s)
            return self._result(context, spec, result, time.time() - started)

    def _pruner(self, spec):
        """What the supervisor asks on every poll whether to stop the job as pruned (a sweep trial's); none here."""
        return None

    def _result(self, context, spec, result: Any, wall_s: float) -> Any:
        """The task's XCom: rank 0's result with the job's folder and wall time."""
        result = {} if result is None else result
        if isinstance(result, dict):
            return {**result, "job_dir": str(spec.job_dir), "wall_s": round(wall_s, 3)}
        return result

    def on_kill(self) -> None:
        """Airflow calls this when the task is killed (cleared, marked failed, timed out): stop every rank."""
        if self._job is not None:
            self._job.stop()


@contextlib.contextmanager
def user_errors_fail():
    """A ``UserError`` (bad config or data, a rank's included) fails the task without retries."""
    from airflow.sdk.exceptions import AirflowFailException

    from pipeline.errors import UserError

    try:
        yield
    except UserError as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


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
                self.entry = ["-m", "pipeline.train.function", str(payload), str(result)]
                TorchrunOperator.execute(self, context)  # defers with launch.<kind>.deferrable
                return self._return_value(context)

            def execute_complete(self, context, event, restart, started) -> Any:
                self.entry = ["-m", "pipeline.train.function", *(str(self._folder(context) / name)
                                                                  for name in ("function.pkl", "return_value.pkl"))]
                TorchrunOperator.execute_complete(self, context, event, restart, started)
                return self._return_value(context)

            def _folder(self, context) -> Path:
                ti = context["ti"]
                return job_dir(ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1))

            def _return_value(self, context) -> Any:
                import cloudpickle

                return self._handle_output(cloudpickle.loads((self._folder(context) / "return_value.pkl").read_bytes()))

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
