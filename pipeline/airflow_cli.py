"""`python -m pipeline.airflow_cli ARGS...`: the `airflow` CLI on the embedded default settings.

For example ``dags list``, ``dags test tabular_mlp``, or ``standalone`` for the UI on 127.0.0.1:8080.
Any AIRFLOW__* variable already set (a PostgreSQL connection, another home) wins.
"""

from __future__ import annotations

import os
import sys

from pipeline import settings


def main() -> None:
    settings.apply_airflow_env()
    os.execvp(sys.executable, [sys.executable, "-m", "airflow", *sys.argv[1:]])


if __name__ == "__main__":
    main()
