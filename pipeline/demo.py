"""`make demo`: generate the demo Parquet, run the `tabular_mlp` DAG through Airflow, summarize.

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

from pipeline import settings

DAG_ID = "tabular_mlp"


def run_dag(dag_id: str, conf: dict[str, Any], dag_file: Path | None = None):
    """Run one DAG run in-process with ``dag.test`` (Airflow parses, serializes and runs it).

    The DAG is read from ``dag_file``, by default ``dags/<dag_id>.py``.
    """
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(dag_file or settings.PROJECT_ROOT / "dags" / f"{dag_id}.py"))
    if bag.import_errors:
        raise SystemExit(f"DAG import errors: {bag.import_errors}")
    if dag_file is not None:
        from airflow.dag_processing.bundles.manager import DagBundlesManager
        from airflow.dag_processing.dagbag import sync_bag_to_db

        DagBundlesManager().sync_bundles_to_db()
        sync_bag_to_db(bag, "dags-folder", None)  # dag.test serializes only the dags folder's DAGs
    return bag.get_dag(dag_id).test(run_conf=conf)


def migrate_airflow_db() -> None:
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, stdout=subprocess.DEVNULL)


def human_summary(summary: dict[str, Any], total_s: float) -> str:
    metrics = summary["test_metrics"]
    lines = [
        "",
        "=" * 72,
        f"dataset   {summary['dataset']['uri']} (version {summary['dataset']['version']}"
        f"{', reused' if summary['dataset']['reused'] else ''})",
        f"rows      " + ", ".join(f"{k} {v:,}" for k, v in summary["dataset"]["rows"].items()),
        f"model     {summary['model']['name']} version {summary['model']['version']} "
        f"aliases {summary['model']['aliases']}",
        f"test      accuracy {metrics['accuracy']:.4f} (majority class {metrics['majority_rate']:.4f}), "
        f"macro F1 {metrics['macro_f1']:.4f}, log-loss {metrics['log_loss']:.4f}",
    ]
    champion = summary["champion_before"]
    if champion:
        lines.append(f"champion  version {champion['version']} before this run: accuracy "
                     f"{champion['metrics']['accuracy']:.4f}")
    lines += [
        f"promotion {'promoted' if summary['promoted'] else 'not promoted'}: {summary['reason']}",
        "stages    " + ", ".join(f"{k} {v:.1f}s" for k, v in summary["wall_s"].items()) + f"; total {total_s:.1f}s",
        "=" * 72,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.demo", description=__doc__)
    parser.add_argument("--rows", type=int, default=60_000, help="rows of demo data to generate (default 60000)")
    parser.add_argument("--conf", default="{}", help="extra DAG run conf as JSON, e.g. '{\"epochs\": 3}'")
    args = parser.parse_args(argv)

    settings.apply_airflow_env()
    started = time.perf_counter()
    from pipeline.data import demo
    from pipeline.recipes import tabular_mlp

    input_path = Path(tabular_mlp.demo_input_path())
    if not input_path.exists():
        print(f"writing {args.rows:,} demo rows to {input_path}", flush=True)
        demo.write_parquet(input_path, args.rows)
    migrate_airflow_db()
    conf = {"input_path": str(input_path), **json.loads(args.conf)}
    dag_run = run_dag(DAG_ID, conf)
    state = str(getattr(dag_run.state, "value", dag_run.state))
    from pipeline.stages import RunInfo

    summary_path = RunInfo(DAG_ID, dag_run.run_id).workdir / "summary.json"
    if state != "success" or not summary_path.exists():
        print(f"DAG run {dag_run.run_id} ended in state {state}; see the task logs above", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    total_s = time.perf_counter() - started
    print(human_summary(summary, total_s))
    print(json.dumps({
        "dag_run_id": dag_run.run_id,
        "dataset": summary["dataset"],
        "model": summary["model"],
        "test_metrics": summary["test_metrics"],
        "promoted": summary["promoted"],
        "wall_s": summary["wall_s"] | {"total": round(total_s, 3)},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
