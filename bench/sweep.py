"""What pruning saves: the same sweep of the tabular recipe (8 trials by default, TPE with the same seed) run with the
median pruner and with none, side by side: wall time of each, their ratio (target <= 0.6), and the best trial's
validation loss of each (target: within 1%).

    .venv/bin/python bench/sweep.py [--trials 8 --epochs 20 --rows 60000 --ranks 2 --at-once 1]

Each trial goes through the sweep's own stages, as a `<recipe>_sweep` DAG's mapped train task does
(``pipeline.stages.sweep``: the study's trial for the slot, its training job with a child MLflow run, the pruner
asked by the supervisor on every poll, the study told how it ended), on real torchrun ranks, outside Airflow.
Everything is written under a temporary PIPELINE_HOME (data, MLflow, the studies' SQLite database).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_sweep(pruner: str, args, input_path: str, tag: str) -> dict:
    from pipeline.errors import TrainingPruned
    from pipeline.job.supervisor import Job
    from pipeline.recipes import get_recipe
    from pipeline.stages import prepare_data, trained_model
    from pipeline.stages.run import RunInfo
    from pipeline.stages.sweep import best_trial, plan_sweep, start_trial, trial_completed, trial_job, trial_pruned
    from pipeline.sweep.pruning import EpochPruner
    from pipeline.sweep.study import Sweep

    params = {"variant": "tiny", "input_path": input_path, "epochs": args.epochs, "nproc_per_node": args.ranks,
              "overrides": {"data.shard_size_limit_bytes": 1 << 20, "train.log_every_steps": 1000}}
    base = get_recipe("tabular_mlp").config_from_params(params)
    sweep = Sweep.from_params({
        "search_space": {"train.learning_rate": {"low": 1e-5, "high": 1e-1, "log": True},
                         "train.weight_decay": {"low": 1e-6, "high": 1e-1, "log": True}},
        "n_trials": args.trials, "pruner": pruner, "sampler_seed": args.seed, "prune_after_trials": 2,
        "prune_after_epochs": 1}, base)
    run = RunInfo("bench_sweep", f"{tag}-{pruner}")
    dataset = prepare_data(base, run)
    started = time.perf_counter()
    plan_sweep(base, run, sweep)

    def trial(slot: int) -> str:
        state = start_trial(base, run, sweep, slot)
        spec = trial_job(state, run, dataset, slot)
        trial_started = time.perf_counter()
        job = Job(spec, pruner=EpochPruner(state.trial, spec.files.metrics, sweep.config.objective))
        try:
            result = job.run(emit=lambda line: None)
        except TrainingPruned as pruned:
            trial_pruned(state, spec, str(pruned))
            return "pruned"
        trial_completed(state, trained_model(spec, result, time.perf_counter() - trial_started))
        return "complete"

    with ThreadPoolExecutor(args.at_once) as pool:
        ends = list(pool.map(trial, range(args.trials)))
    wall = time.perf_counter() - started
    best = best_trial(base, run, sweep)["details"]["sweep"]
    return {"pruner": pruner, "wall_s": round(wall, 1), "pruned": ends.count("pruned"), "best_val_loss": best["value"],
            "best_params": best["params"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--at-once", type=int, default=1, help="trials training side by side")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    os.environ["PIPELINE_HOME"] = str(home)
    for key in ("PIPELINE_DATA_DIR", "PIPELINE_RUNS_DIR", "MLFLOW_TRACKING_URI", "PIPELINE_SWEEP_DB"):
        os.environ.pop(key, None)
    sys.path.insert(0, str(ROOT))
    from pipeline.data import demo

    input_path = str(demo.write_parquet(home / "inputs" / "demo.parquet", args.rows, seed=1))
    tag = time.strftime("%Y%m%dT%H%M%S")
    print(f"{args.trials} trials of tabular_mlp, {args.epochs} epochs of {args.rows:,} rows, {args.ranks} ranks each, "
          f"{args.at_once} at a time; home {home}", flush=True)
    rows = []
    for pruner in ("median", "none"):
        rows.append(run_sweep(pruner, args, input_path, tag))
        print(json.dumps(rows[-1]), flush=True)
    pruned, unpruned = rows
    ratio = pruned["wall_s"] / unpruned["wall_s"]
    gap = abs(pruned["best_val_loss"] - unpruned["best_val_loss"]) / unpruned["best_val_loss"]
    print(f"{'pruner':<8}{'wall s':>9}{'pruned':>8}{'best val_loss':>15}")
    for row in rows:
        print(f"{row['pruner']:<8}{row['wall_s']:>9.1f}{row['pruned']:>8}{row['best_val_loss']:>15.5f}")
    print(f"wall time with pruning / without: {ratio:.3f} (target <= 0.6); best val_loss differs by {gap:.2%} "
          f"(target within 1%)")


if __name__ == "__main__":
    main()
