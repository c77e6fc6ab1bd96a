"""Training runtime overhead: a minimal hand-written DDP loop vs the pipeline's train stage, same data and model.

    .venv/bin/python bench/train_overhead.py [--rows 200000 --epochs 2 --nproc 2 --repeats 2]

(a) `bench/minimal_ddp.py` under plain torchrun: model, optimizer, loader, steps, a validation pass.
(b) `pipeline.stages.train`: the supervised launcher (guard, heartbeats, stall watchdog) and the
    training entrypoint with checkpoints every --checkpoint-every steps and at each epoch end, and
    step metrics written by rank 0 to the job folder and relayed to MLflow (a local SQLite store) by the
    supervising process.
Runs alternate a, b, a, b, ... and the medians are compared: the ratio is (b)/(a).
"""

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-train-"))
    os.environ["PIPELINE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    sys.path.insert(0, str(ROOT))
    from pipeline import stages
    from pipeline.data import demo
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

    minimal, pipeline = [], []
    for i in range(args.repeats):
        out = home / f"minimal-{i}"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
             str(ROOT / "bench" / "minimal_ddp.py"), "--config", str(config_path), "--dataset", dataset.uri,
             "--out", str(out)],
            check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        minimal.append(json.loads((out / "result.json").read_text())["samples_per_s"])
        print(f"(a) minimal DDP loop   run {i + 1}: {minimal[-1]:9,.0f} samples/s  "
              f"(process wall {time.perf_counter() - started:.1f}s)", flush=True)
        started = time.perf_counter()
        trained = stages.train(cfg, stages.RunInfo("bench", f"pipeline-{i}"), dataset)
        result = trained.details
        pipeline.append(result["throughput"]["samples_per_s"])
        checkpoints = len(list(Path(result["out_dir"]).glob("checkpoints/step-*")))
        print(f"(b) pipeline train     run {i + 1}: {pipeline[-1]:9,.0f} samples/s  "
              f"(process wall {time.perf_counter() - started:.1f}s, data-wait "
              f"{result['throughput']['data_wait_fraction']:.0%}, {checkpoints} checkpoints kept, "
              f"{result['steps']} steps, MLflow run {trained.mlflow_run_id})", flush=True)
    a, b = statistics.median(minimal), statistics.median(pipeline)
    print(f"\nmedian samples/s: (a) minimal {a:,.0f}   (b) pipeline {b:,.0f}   ratio (b)/(a) = {b / a:.3f} "
          f"(target >= 0.97)")


if __name__ == "__main__":
    main()
