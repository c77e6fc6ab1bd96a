"""Time to first step and orchestration overhead of the tabular demo, beside a bare torchrun baseline.

    .venv/bin/python bench/latency.py [--repeats 2] [--no-dag] [--keep]

(a) bare: ``torchrun --standalone --nproc-per-node=2`` of a script that imports torch, initialises gloo and
    takes one AdamW step on a tensor; from the launch to that step.
(b) the pipeline's ranks: the tabular demo's training job (the ``demo`` variant, its 60,000 rows) under the
    supervisor, as the train task runs it; from the launch to each phase of rank 0's timeline (process
    start, imports done, process group ready, run context ready, data opened, model and data ready, first
    step, last step, model saved).
(c) the DAG: ``python -m pipeline.dev.demo`` twice in a fresh PIPELINE_HOME (the second reuses the dataset,
    as a user's second run does); each task's duration from Airflow's metadata DB, the run's wall time minus
    the training loop's, the process's time outside its tasks (before the first, between them, after the
    last), the train task's phases from its start (the launch, from its log line; rank 0's timeline; the
    task's end), and register_model's and evaluate's own phases.
(a) and (b) alternate; medians are compared. The last line is one JSON object. Everything is written under one
temporary folder, removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BARE = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
weights = torch.nn.Parameter(torch.ones(16))
optimizer = torch.optim.AdamW([weights], lr=0.1)
dist.all_reduce(grad := torch.ones(16))
weights.grad = grad
optimizer.step()
if dist.get_rank() == 0:
    print(f"FIRST_STEP {time.time()}", flush=True)
dist.destroy_process_group()
"""
PHASES = ("process_start", "imports_done", "process_group_ready", "run_context_ready", "data_opened",
          "model_and_data_ready", "first_step", "last_step", "model_saved")


def bare_first_step(script: Path) -> float:
    launched = time.time()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], check=True, capture_output=True, text=True)
    stamp = next(line for line in done.stdout.splitlines() if line.startswith("FIRST_STEP "))
    return float(stamp.split()[1]) - launched


def pipeline_phases(cfg, dataset, job_dir: Path) -> dict[str, float]:
    from pipeline.job.spec import JobSpec, launch_config
    from pipeline.job.supervisor import Job

    (job_dir / "config.json").parent.mkdir(parents=True, exist_ok=True)
    (job_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    launched = time.time()
    spec = JobSpec(entry=["-m", "pipeline.rank", "--config", str(job_dir / "config.json"), "--dataset", dataset.uri],
                   job_dir=job_dir, launch=launch_config({"nproc_per_node": 2}))
    result = Job(spec).run(lambda line: None)
    phases = {name: at - launched for name, at in result["timeline"].items()}
    return phases | {"training_s": result["train_wall_s"]}


def dag_runs(home: Path) -> list[dict]:
    """Two demo runs in ``home``: each one's tasks' durations, wall time and training time."""
    env = {**os.environ, "PIPELINE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("AIRFLOW_HOME", None)
    runs = []
    for _ in range(2):
        started, began = time.perf_counter(), time.time()
        done = subprocess.run([sys.executable, "-m", "pipeline.dev.demo"], check=True, capture_output=True,
                              text=True, env=env, cwd=ROOT)
        wall, ended = time.perf_counter() - started, time.time()
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        workdir = home / "runs" / "tabular_mlp" / re.sub(r"[^A-Za-z0-9._-]+", "_", summary["dag_run_id"])
        result = json.loads(next(workdir.glob("train*/result.json")).read_text())
        with sqlite3.connect(home / "airflow" / "airflow.db") as db:
            spans = {task: (start, end) for task, start, end in db.execute(  # Unix times
                "SELECT task_id, (julianday(start_date) - 2440587.5) * 86400, (julianday(end_date) - 2440587.5) "
                "* 86400 FROM task_instance WHERE run_id = ?", (summary["dag_run_id"],)).fetchall()}
            # register_model's and evaluate's own phases (model logging, registration; scoring, report), from
            # their results.
            phases = {task: json.loads(value).get("phases", {}) for task, value in db.execute(
                "SELECT task_id, value FROM xcom WHERE run_id = ? AND key = 'return_value' AND task_id IN "
                "('register_model', 'evaluate')", (summary["dag_run_id"],)).fetchall()}
        # The train task from its start: the launch (its log line's time), rank 0's phases, the task's end.
        launch = re.search(r"^(\S+)Z \[info\s*\] launching: ", done.stdout + done.stderr, re.MULTILINE)
        launched = {"launch": datetime.fromisoformat(launch[1]).replace(tzinfo=timezone.utc).timestamp()
                    } if launch else {}
        start, end = spans["train"]
        train_phases = {name: at - start for name, at in (launched | result["timeline"]).items()} | {
            "task_end": end - start}
        runs.append({"wall_s": wall, "tasks": {task: e - s for task, (s, e) in spans.items()}, "phases": phases,
                     "outside_tasks": outside_tasks(began, ended, spans),
                     "train_phases": train_phases, "training_s": result["train_wall_s"],
                     "data_wait_fraction": result.get("throughput", {}).get("data_wait_fraction"),
                     "accuracy": summary["test_metrics"].get("accuracy")})
    return runs


def outside_tasks(began: float, ended: float, spans: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The demo process's time outside its tasks: before the first one starts (interpreter, Airflow's imports and
    schema check, parsing and serializing the DAGs, creating the run, the in-process execution API), between
    tasks (Airflow's bookkeeping), and after the last one ends (the summary, the process's exit)."""
    ordered = sorted(spans.values())
    return {"before_first_task": ordered[0][0] - began,
            "between_tasks": sum(max(0.0, b[0] - a[1]) for a, b in zip(ordered, ordered[1:])),
            "after_last_task": ended - max(end for _, end in ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-dag", action="store_true", help="only (a) and (b)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (data, job folders, the "
                        "DAG runs' Airflow and MLflow stores) and print its path")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    try:
        measure(args, home)
    finally:
        if args.keep:
            print(f"kept {home}", file=sys.stderr)
        else:
            shutil.rmtree(home, ignore_errors=True)


def measure(args: argparse.Namespace, home: Path) -> None:
    os.environ["PIPELINE_HOME"] = str(home / "ranks")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    sys.path.insert(0, str(ROOT))
    from pipeline import stages
    from pipeline.recipes import get_recipe

    recipe = get_recipe("tabular_mlp")
    recipe.demo_input()
    cfg = recipe.config("demo")
    dataset = stages.prepare_data(cfg, stages.RunInfo("bench-latency", "prep"))
    script = home / "bare.py"
    script.write_text(BARE)

    bare, ranks = [], []
    for i in range(args.repeats):
        bare.append(bare_first_step(script))
        ranks.append(pipeline_phases(cfg, dataset, home / f"job-{i}"))
        print(f"run {i + 1}: (a) bare launch -> first step {bare[-1]:.2f}s; (b) pipeline launch -> "
              + ", ".join(f"{name.replace('_', ' ')} {ranks[-1][name]:.2f}s" for name in PHASES), flush=True)
    a = statistics.median(bare)
    b = {name: statistics.median(r[name] for r in ranks) for name in (*PHASES, "training_s")}
    ratio = b["first_step"] / a
    print(f"\nmedian launch -> first step: (a) bare {a:.2f}s, (b) pipeline {b['first_step']:.2f}s: "
          f"ratio {ratio:.2f} (target <= 2)")
    print("(b) phase by phase: " + ", ".join(
        f"{name.replace('_', ' ')} +{b[name] - (b[prev] if prev else 0):.2f}s"
        for prev, name in zip((None, *PHASES), PHASES)))
    figures = {"bare_first_step_s": round(a, 3), "pipeline_first_step_s": round(b["first_step"], 3),
               "launch_to_first_step_ratio": round(ratio, 3)}
    if not args.no_dag:
        runs = dag_runs(home / "dag")
        for i, run in enumerate(runs):
            print(f"DAG run {i + 1}: wall {run['wall_s']:.1f}s, training {run['training_s']:.1f}s, tasks: "
                  + ", ".join(f"{task} {s:.1f}s" for task, s in run["tasks"].items())
                  + f"; accuracy {run['accuracy']}; rank 0's data wait {run['data_wait_fraction']:.1%} of training")
            print("  outside the tasks: " + ", ".join(
                f"{name.replace('_', ' ')} {s:.1f}s" for name, s in run["outside_tasks"].items()))
            print("  train from the task's start: " + ", ".join(
                f"{name.replace('_', ' ')} {s:.1f}s" for name, s in run["train_phases"].items()))
            for task, phases in run["phases"].items():
                print(f"  {task}: " + ", ".join(f"{name} {s:.1f}s" for name, s in phases.items()))
        second = runs[-1]
        figures |= {"dag_wall_s": round(second["wall_s"], 3), "dag_overhead_s": round(second["wall_s"] - second["training_s"], 3),
                    "register_s": round(second["tasks"].get("register_model", 0.0), 3),
                    "evaluate_s": round(second["tasks"].get("evaluate", 0.0), 3),
                    "train_task_s": round(second["tasks"].get("train", 0.0), 3),
                    "data_wait_fraction": second["data_wait_fraction"],
                    "outside_tasks_s": round(sum(second["outside_tasks"].values()), 3)}
        print(f"second DAG run: wall minus training {figures['dag_overhead_s']:.1f}s (target <= 15), register "
              f"{figures['register_s']:.1f}s and evaluate {figures['evaluate_s']:.1f}s (targets <= 3)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
