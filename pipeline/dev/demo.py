"""`make demo [RECIPE=name]`: write the recipe's demo data, run its DAG through Airflow, summarize.

``--conf '{"input_path": ...}'`` runs it on data of the user's instead, with the recipe's default variant.

``--sweep`` runs the recipe's sweep DAG instead (``<recipe>_sweep``): its best trial is the model summarized.

Runs on the embedded default (SQLite Airflow, local MLflow, local torchrun). The last line printed
is one JSON object with the dataset, the model version and aliases, test metrics and stage times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline import deployment
from pipeline.results import Promotion

DEFAULT_RECIPE = "tabular_mlp"
# --launch: the run's config overrides. Ray: half a CPU per worker leaves CPUs to Ray Data on small machines.
LAUNCHES = {"local": {}, "ray": {"launch.kind": "ray", "launch.ray.cpus_per_worker": 0.5, "data.reader": "ray"}}


def run_dag(dag_id: str, conf: dict[str, Any], dag_file: Path | None = None):
    """Run one DAG run in-process with ``dag.test`` (Airflow parses, serializes and runs it).

    The DAG is read from ``dag_file``, by default ``dags/<dag_id>.py``. The tasks' execution API is built for
    the task SDK's own API version only (``pipeline.dev.execution_api``).
    """
    from airflow.dag_processing.dagbag import DagBag

    from pipeline.dev.execution_api import build_for_sdk_version

    bag = DagBag(dag_folder=str(dag_file or deployment.PROJECT_ROOT / "dags" / f"{dag_id}.py"))
    if bag.import_errors:
        raise SystemExit(f"DAG import errors: {bag.import_errors}")
    if dag_file is not None:
        from airflow.dag_processing.bundles.manager import DagBundlesManager
        from airflow.dag_processing.dagbag import sync_bag_to_db

        DagBundlesManager().sync_bundles_to_db()
        sync_bag_to_db(bag, "dags-folder", None)  # dag.test serializes only the dags folder's DAGs
    build_for_sdk_version()
    return bag.get_dag(dag_id).test(run_conf=conf)


def ensure_demo_inputs(rows_per_day: int = 2_000) -> list[str]:
    """Inputs a UI trigger of the tabular DAGs reads in a fresh home: the demo Parquet, and one daily
    partition for every day from ``PIPELINE_DAILY_START_DATE`` through today (what unpausing
    ``tabular_daily_prep`` catches up on). Days already there are kept; returns what was written."""
    from datetime import date, timedelta

    from pipeline.data import demo
    from pipeline.recipes import get_recipe
    from pipeline.recipes.tabular_mlp import daily_input_path

    written = []
    recipe = get_recipe("tabular_mlp")
    if not Path(recipe.demo_input_path()).exists():
        written.append(recipe.demo_input())
    start, today = date.fromisoformat(deployment.daily_start_date()), date.today()
    root = Path(daily_input_path())
    days = [str(start + timedelta(days=i)) for i in range((today - start).days + 1)]
    missing = [day for day in days if not (root / f"dt={day}").exists()]
    for day in missing:
        demo.write_partitions(root, [day], rows_per_day, seed=1000 + days.index(day))
        written.append(str(root / f"dt={day}"))
    return written


def migrate_airflow_db() -> None:
    """Bring Airflow's metadata DB to the installed version's schema. A DB already there (every run after the
    first) is only checked, in this process, which imports Airflow's models for ``dag.test`` anyway: the
    ``airflow db migrate`` command costs seconds of start-up even when it has nothing to do."""
    if not _airflow_db_current():
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, stdout=subprocess.DEVNULL)


def _airflow_db_current() -> bool:
    from sqlalchemy.exc import SQLAlchemyError

    from airflow.utils.db import check_migrations

    try:
        check_migrations(timeout=1)
    except (TimeoutError, SQLAlchemyError):
        return False
    return True


def demo_conf(recipe, conf: dict[str, Any]) -> dict[str, Any]:
    """The DAG run's conf: ``conf`` over the demo's input and the recipe's ``demo`` variant, whose settings are for
    the demo's data (Fashion-MNIST's test files, its class names). With an ``input_path`` of the user's, the demo's
    input is neither written nor read and the variant is the recipe's ``default`` unless ``conf`` names one."""
    if conf.get("input_path") and conf["input_path"] != recipe.demo_input_path():
        variant = conf.get("variant", "default")
        print(f"your input {conf['input_path']}: the recipe's {variant!r} variant (the demo variant's settings are "
              f"for the demo's data)", flush=True)
        return {"variant": variant, **conf}
    return {"input_path": recipe.demo_input(), "variant": "demo", **conf}


def human_summary(summary: Promotion, total_s: float) -> str:
    metrics, dataset, model = summary.test_metrics, summary.dataset, summary.model
    baseline = f" (majority class {metrics['majority_rate']:.4f})" if "majority_rate" in metrics else ""
    lines = [
        "",
        "=" * 72,
        f"dataset   {dataset.uri} (version {dataset.version}{', reused' if dataset.reused else ''})",
        "rows      " + ", ".join(f"{k} {v:,}" for k, v in dataset.rows.items()),
        f"model     {model.name} version {model.version} aliases {list(model.aliases)}",
        "test      " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k not in ("rows", "majority_rate"))
        + baseline,
    ]
    champion = summary.champion_before
    if champion:
        lines.append(f"champion  version {champion.version} before this run: "
                     + ", ".join(f"{k} {v:.4f}" for k, v in champion.metrics.items() if k != "rows"))
    lines += [
        f"promotion {'promoted' if summary.promoted else 'not promoted'}: {summary.reason}",
        "stages    " + ", ".join(f"{k} {v:.1f}s" for k, v in summary.wall_s.items()) + f"; total {total_s:.1f}s",
        "=" * 72,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.dev.demo", description=__doc__)
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"recipe (and DAG) to run (default {DEFAULT_RECIPE})")
    parser.add_argument("--conf", default="{}", help="extra DAG run conf as JSON, e.g. '{\"epochs\": 3}'")
    parser.add_argument("--launch", choices=sorted(LAUNCHES), default="local",
                        help="where training runs: local (torchrun) or ray (Ray Train on a local Ray cluster, "
                        "fed by Ray Data)")
    parser.add_argument("--sweep", action="store_true",
                        help="run the recipe's sweep DAG (<recipe>_sweep: n_trials mapped trials, the best released); "
                        "its Params in --conf, e.g. '{\"n_trials\": 4}'")
    args = parser.parse_args(argv)

    deployment.apply_airflow_env()
    started = time.perf_counter()
    from pipeline.airflow.preload import preload_while_a_job_runs

    # The tasks run in this process: it is their warm worker, from when the train task has started its ranks.
    preload_while_a_job_runs()
    from pipeline.recipes import get_recipe

    recipe = get_recipe(args.recipe)
    conf = demo_conf(recipe, json.loads(args.conf))
    migrate_airflow_db()
    if LAUNCHES[args.launch]:
        conf["overrides"] = {**LAUNCHES[args.launch], **conf.get("overrides", {})}
    dag_id = f"{recipe.name}_sweep" if args.sweep else recipe.name
    dag_run = run_dag(dag_id, conf, deployment.PROJECT_ROOT / "dags" / "sweeps.py" if args.sweep else None)
    state = str(getattr(dag_run.state, "value", dag_run.state))
    from pipeline.stages.run import RunInfo

    summary_path = RunInfo(dag_id, dag_run.run_id).workdir / "summary.json"
    if state != "success" or not summary_path.exists():
        print(f"DAG run {dag_run.run_id} ended in state {state}; see the task logs above", file=sys.stderr)
        return 1
    summary = Promotion.from_xcom(json.loads(summary_path.read_text()))
    total_s = time.perf_counter() - started
    print(human_summary(summary, total_s))
    baseline = summary.train.baseline_metrics
    print(json.dumps({
        "dag_run_id": dag_run.run_id,
        "dataset": summary.dataset.to_xcom(),
        "model": summary.model.to_xcom(),
        "test_metrics": summary.test_metrics,
        **({"before_training": baseline} if baseline is not None else {}),
        "promoted": summary.promoted,
        **({"training_cost": summary.train.cost} if summary.train.cost else {}),
        **({"sweep": summary.train.sweep} if summary.train.sweep else {}),
        "wall_s": summary.wall_s | {"total": round(total_s, 3)},
    }))
    return 0


if __name__ == "__main__":
    from pipeline.fast_exit import exit_main

    exit_main("pipeline.dev.demo", main())  # without tearing down Airflow's, MLflow's and torch's modules
