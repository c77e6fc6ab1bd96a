"""`python -m pipeline.dev.airflow_cli ARGS...`: the `airflow` CLI on the embedded default deployment.

For example ``dags list``, ``dags test tabular_mlp`` or ``backfill create ...``; ``make ui`` brings up
the UIs. Any AIRFLOW__* variable already set (a PostgreSQL connection, another home) wins.
"""

from __future__ import annotations

import os
import sys

from pipeline import deployment


def paused_backfill_warning(args: list[str]) -> str | None:
    """What to tell a user creating a backfill of a paused DAG (its runs would wait, queued, in silence)."""
    if args[:2] != ["backfill", "create"]:
        return None
    dag_id = next((value.split("=", 1)[1] for value in args if value.startswith("--dag-id=")), None)
    if dag_id is None and "--dag-id" in args[:-1]:
        dag_id = args[args.index("--dag-id") + 1]
    if not dag_id or not is_paused(dag_id):
        return None
    return (f"warning: DAG {dag_id} is paused: the backfill's runs stay queued until it is unpaused "
            f"(make airflow ARGS=\"dags unpause {dag_id}\", or the toggle in the UI). Unpausing a DAG with "
            "catchup also schedules every interval since its start date (tabular_daily_prep: "
            f"PIPELINE_DAILY_START_DATE={deployment.daily_start_date()}).")


def is_paused(dag_id: str) -> bool:
    """True when the metadata DB knows ``dag_id`` and has it paused."""
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session

    try:
        with create_session() as session:
            model = session.get(DagModel, dag_id)
    except Exception:  # no DB yet: the backfill command reports that itself
        return False
    return bool(model and model.is_paused)


def main() -> None:
    deployment.apply_airflow_env()
    # Airflow's own subprocesses (standalone's components) find `airflow` beside this interpreter.
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    warning = paused_backfill_warning(sys.argv[1:])
    if warning:
        print(warning, file=sys.stderr, flush=True)
    os.execvp(sys.executable, [sys.executable, "-m", "airflow", *sys.argv[1:]])


if __name__ == "__main__":
    main()
