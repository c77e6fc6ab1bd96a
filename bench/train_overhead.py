"""Training runtime overhead: a minimal hand-written DDP loop vs the pipeline's train stage, same data and model.

    .venv/bin/python bench/train_overhead.py [--rows 200000 --epochs 2 --nproc 2 --repeats 5]

(a) `bench/minimal_ddp.py` under plain torchrun: model, optimizer, loader, steps, a validation pass.
(b) the train task's path (`stages.train_job`, the supervisor's `Job`, `stages.trained_model`): the supervised
    launcher (guard, heartbeats, stall watchdog) and the training entrypoint with checkpoints every --checkpoint-every steps and at each epoch end, and
    step metrics written by rank 0 to the job folder and relayed to MLflow (a local SQLite store) by the
    supervising process.
Each repeat is a pair of runs back to back, (a) then (b) or (b) then (a) in turn, and its ratio (b)/(a) is
taken within the pair, which cancels a drift of the machine's speed over minutes but not its noise from one
run to the next (10-30% on a shared 2-core machine, more than the difference measured). The figure is the
median of the pairs' ratios, printed with their range and with the ratio of the two medians; beside it, the
shares of rank 0's training time that the pipeline's loop spent on its own work (checkpoints, preemption
checks), timed inside each run, which that noise does not blur."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the pipeline's loop does that the minimal one does not, timed by the loop itself (its throughput figures).
OWN_WORK = ("checkpoint", "preemption_check")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-train-"))
    os.environ["PIPELINE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    sys.path.insert(0, str(ROOT))
    from pipeline import stages
    from pipeline.data import demo
    from pipeline.job.supervisor import Job
    from pipeline.recipes import tabular_mlp

    parquet = demo.write_parquet(home / "inputs" / "bench.parquet", args.rows, seed=0)
    cfg = tabular_mlp.config().with_overrides({
        "data.input_path": str(parquet), "train.epochs": args.epochs, "train.batch_size": args.batch_size,
        "train.checkpoint_every_steps": args.checkpoint_every, "train.log_every_steps": 20,
        "launch.nproc_per_node": args.nproc,
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("bench", "prep"))
    config_path = home / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    print(f"{args.rows:,} rows ({dataset.rows}), {args.epochs} epochs, batch {args.batch_size}, "
          f"{args.nproc} ranks, checkpoint every {args.checkpoint_every} steps", flush=True)

    def run_minimal(i: int) -> float:
        out = home / f"minimal-{i}"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
             str(ROOT / "bench" / "minimal_ddp.py"), "--config", str(config_path), "--dataset", dataset.uri,
             "--out", str(out)],
            check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        speed = json.loads((out / "result.json").read_text())["samples_per_s"]
        print(f"(a) minimal DDP loop   run {i + 1}: {speed:9,.0f} samples/s  "
              f"(process wall {time.perf_counter() - started:.1f}s)", flush=True)
        return speed

    def run_pipeline(i: int) -> float:
        started = time.perf_counter()
        spec = stages.train_job(cfg, stages.RunInfo("bench", f"pipeline-{i}"), dataset)
        trained = stages.trained_model(spec, Job(spec).run(), time.perf_counter() - started)
        result = trained.details
        checkpoints = len(list(Path(result["out_dir"]).glob("checkpoints/step-*")))
        figures = result["throughput"]
        own.append({phase: figures.get(f"{phase}_fraction", 0.0) for phase in OWN_WORK})
        print(f"(b) pipeline train     run {i + 1}: {figures['samples_per_s']:9,.0f} samples/s  "
              f"(process wall {time.perf_counter() - started:.1f}s, data-wait {figures['data_wait_fraction']:.1%}, "
              f"validation {figures.get('validation_fraction', 0.0):.1%}, "
              + ", ".join(f"{phase} {share:.1%}" for phase, share in own[-1].items())
              + f"; {checkpoints} checkpoints kept, {result['steps']} steps, MLflow run {trained.mlflow_run_id})",
              flush=True)
        return figures["samples_per_s"]

    minimal, pipeline, own = [], [], []
    for i in range(args.repeats):
        if i % 2 == 0:
            minimal.append(run_minimal(i))
            pipeline.append(run_pipeline(i))
        else:
            pipeline.append(run_pipeline(i))
            minimal.append(run_minimal(i))
        print(f"    pair {i + 1}: ratio (b)/(a) = {pipeline[-1] / minimal[-1]:.3f}", flush=True)
    ratios = [b / a for a, b in zip(minimal, pipeline)]
    a, b = statistics.median(minimal), statistics.median(pipeline)
    print(f"\nmedian samples/s: (a) minimal {a:,.0f}   (b) pipeline {b:,.0f}   ratio of medians {b / a:.3f}")
    print(f"median of the {len(ratios)} pairs' ratios (b)/(a) = {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f} to {max(ratios):.3f}; target >= 0.97)")
    shares = {phase: statistics.median(run[phase] for run in own) for phase in OWN_WORK}
    print("the pipeline loop's own work, measured inside its runs (median share of rank 0's training time): "
          + ", ".join(f"{phase} {share:.1%}" for phase, share in shares.items())
          + f"; 1 - their sum = {1 - sum(shares.values()):.3f}")

if __name__ == "__main__":
    main()
