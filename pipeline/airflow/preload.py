"""Preloading for task processes: the heavy modules the stages import, imported once by the process that starts tasks.

A task imports torch, torch.export's loader (which imports torch._dynamo), MLflow, pandas, pyarrow,
streaming and matplotlib before it does any work of its own: 4 to 4.5 s of ``register_model``
(docs/performance.md), and their share of every other task, in every run. Airflow forks each task's
process from the process that runs it (a Celery worker's pool process), and a forked process starts
with what its parent had imported. So:

- a Celery worker imports them when it starts, before its pool forks (``CELERY_CONFIG``: set
  ``[celery] celery_config_options`` to ``pipeline.airflow.preload.CELERY_CONFIG``, as ``docker-compose.yml`` and
  ``make stack`` do);
- ``make demo``, which runs every task inside its own process (``dag.test``), imports them on a thread once
  the train task has started its ranks (``preload_while_a_job_runs``, an Airflow listener on the task's start): its
  interpreter is idle then, and the thread's low CPU priority leaves the cores to the ranks (under Linux's
  autogroup scheduling, the whole session's while the thread imports: ``session_niceness``). Started with
  Airflow instead, the thread contended with Airflow's start for the interpreter lock (that start took
  twice as long) and then with the ranks for the cores. A task of that process waits until the thread has
  finished importing (``settled``, from ``pipeline.airflow.tasks.task_run``): code that looks a module up in
  ``sys.modules`` would find it half-imported (``matplotlib.use`` then fails on ``matplotlib.pyplot``).

``PIPELINE_PRELOAD`` names the modules (comma-separated; ``none`` for none). Importing them starts no thread and
touches no device, so forking after it is safe; a module that fails to import is logged and skipped: the task
that needs it fails as it would have, with its own error.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from pathlib import Path

from pipeline.private_apis import mlflow_modules_to_packages

log = logging.getLogger(__name__)

AUTOGROUP = Path("/proc/self/autogroup")  # Linux: this session's scheduling group, "/autogroup-N nice K"

# Held by a background preload while it imports (not while it waits for its event): ``settled`` waits for it.
_IMPORTING = threading.Lock()

DEFAULT_MODULES = ("pipeline.data", "torch", "torch.export.pt2_archive", "pandas", "pyarrow.parquet", "streaming",
                   "mlflow.pyfunc", "matplotlib.pyplot")  # the last: the evaluation report's plots


def modules() -> list[str]:
    """The modules to preload: ``PIPELINE_PRELOAD`` (comma-separated, ``none`` for none) or the defaults."""
    value = os.environ.get("PIPELINE_PRELOAD")
    if value is None:
        return list(DEFAULT_MODULES)
    return [] if value.strip().lower() in ("", "none") else [name.strip() for name in value.split(",") if name.strip()]


# What a preloaded module's first use computes once per process and keeps: computed here too. MLflow's first logged
# model maps every installed distribution to its modules, for the model's requirements (about 1.2 s).
AFTER_IMPORT = {"mlflow.pyfunc": mlflow_modules_to_packages}


def preload(names: list[str] | None = None) -> dict[str, float]:
    """Import ``names`` (default ``modules()``) in order, each followed by its ``AFTER_IMPORT`` step; returns
    each one's seconds (0 when already there)."""
    took: dict[str, float] = {}
    for name in modules() if names is None else names:
        started = time.perf_counter()
        try:
            importlib.import_module(name)
            if name in AFTER_IMPORT:
                AFTER_IMPORT[name]()
        except Exception as exc:  # noqa: BLE001 - a warm-up must never stop a worker
            log.warning("preloading %s failed: %s: %s", name, type(exc).__name__, exc)
            continue
        took[name] = round(time.perf_counter() - started, 3)
    if took:
        log.info("preloaded %s in %.1fs", ", ".join(took), sum(took.values()))
    return took


def preload_in_background(names: list[str] | None = None, *, after: threading.Event | None = None,
                          nice: int = 0) -> threading.Thread:
    """``preload`` on a daemon thread: for a process that runs tasks itself, never one that forks afterwards
    (a fork while a thread holds an import lock would leave the child waiting on it). The thread waits for
    ``after`` first, when given, and lowers its own CPU priority by ``nice`` (Linux: one thread's niceness)."""

    def run() -> None:
        if after is not None:
            after.wait()
        if nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except (AttributeError, OSError) as exc:  # not every system sets a thread's priority
                log.debug("preload at normal priority: %s", exc)
        with _IMPORTING, session_niceness(nice):
            preload(names)

    thread = threading.Thread(target=run, name="pipeline-preload", daemon=True)
    thread.start()
    return thread


def preload_while_a_job_runs(*, nice: int = 19, launch_wait_s: float = 30.0) -> threading.Thread:
    """For a process that runs its tasks itself (``make demo``): ``preload_in_background`` from when its first job
    task (a ``TorchrunOperator``, the recipe DAGs' ``train`` among them) has started its job's processes: an
    Airflow listener sees the task start, then the first child process of this one is waited for (up to
    ``launch_wait_s``). The task's thread only waits for its ranks then, and the launch has the interpreter to
    itself."""
    from airflow.listeners import hookimpl
    from airflow.sdk.listener import get_listener_manager

    from pipeline.airflow.operator import TorchrunOperator

    running, launched = threading.Event(), threading.Event()

    class JobTaskStarts:
        @hookimpl
        def on_task_instance_running(self, previous_state, task_instance) -> None:
            if isinstance(getattr(task_instance, "task", None), TorchrunOperator):
                running.set()

    def wait_for_the_launch() -> None:
        import psutil

        running.wait()
        deadline = time.monotonic() + launch_wait_s
        while not psutil.Process().children() and time.monotonic() < deadline:
            time.sleep(0.05)  # no event tells a process that its task started a child: the condition is polled
        launched.set()

    get_listener_manager().add_listener(JobTaskStarts())
    threading.Thread(target=wait_for_the_launch, name="pipeline-preload-wait", daemon=True).start()
    return preload_in_background(after=launched, nice=nice)


@contextlib.contextmanager
def session_niceness(nice: int):
    """This session's autogroup at niceness ``nice`` while the block runs, then back to what it was.

    Linux with autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in Debian's
    and Ubuntu's kernels) shares a core between sessions first and between a session's threads second, so a
    thread's own niceness yields only to the threads of its own session. torchrun starts each rank in a
    session of its own: beside two ranks on two cores, a niceness-19 thread of the demo's session still took
    a third of each core (the ranks' imports 1 s slower). The session's other processes (the shell that
    started the demo) share its lower weight while the block runs. Nothing happens where there is no autogroup
    file or it refuses, nor where the session's niceness is ``nice`` or more already: another process of the
    session may have set it and will set it back (two demos started from one shell)."""
    before = nice  # nothing to set back
    try:
        if nice > 0:
            before = int(AUTOGROUP.read_text().split()[-1])
            if before < nice:
                AUTOGROUP.write_text(str(nice))
    except (OSError, ValueError, IndexError) as exc:
        log.debug("session's niceness unchanged: %s", exc)
        before = nice
    try:
        yield
    finally:
        if before < nice:
            try:
                AUTOGROUP.write_text(str(before))
            except OSError as exc:  # back to 0 or more needs no privilege
                log.warning("could not set this session's niceness back to %s: %s", before, exc)


def settled() -> None:
    """Return once no background preload of this process is importing (at once when none is, or none has
    started yet): a task must not use a module that another thread is still importing."""
    started = time.perf_counter()
    with _IMPORTING:
        pass
    waited = time.perf_counter() - started
    if waited > 0.1:
        log.info("waited %.1fs for this process's preload to finish importing", waited)


def _on_worker_init(**_: object) -> None:
    preload()


def __getattr__(name: str):
    if name == "CELERY_CONFIG":
        # Airflow's own Celery configuration, the same object (Airflow then applies nothing twice). Fetching it is
        # how a Celery worker meets this module, before it starts: the preload runs when the worker starts, in its
        # main process, before the pool's processes fork (its signal never fires in a scheduler).
        from airflow.providers.celery.executors.default_celery import (
            DEFAULT_CELERY_CONFIG,
        )
        from celery.signals import worker_init

        worker_init.connect(_on_worker_init, weak=False, dispatch_uid=__name__)
        return DEFAULT_CELERY_CONFIG
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
