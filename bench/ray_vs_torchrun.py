"""Ray against torchrun on the image recipe, same data, model and seed, side by side in one run.

    .venv/bin/python bench/ray_vs_torchrun.py [--images 20000 --epochs 2 --nproc 2]

(a) launch.kind=local: torchrun, the MDS reader in each rank;
(b) launch.kind=ray: Ray Train workers on a local Ray cluster (started once, reported apart), the MDS reader;
(c) launch.kind=ray with data.reader=ray: the training split streamed by Ray Data.
Per run: training samples/s (rank 0's loop, steps only), data-wait share, the loop's wall time, and start-up +
teardown (the job's wall time minus the loop's: launch, imports, data opening, model saving, the end).
The images are the first --images of Fashion-MNIST's training set (Debian's ``dataset-fashion-mnist``), the
network the image demo's ([16, 32, 64], no augmentation). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def fashion_mnist(count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` training images of Fashion-MNIST and their labels, from Debian's ``dataset-fashion-mnist``
    (installed when missing, ``pipeline.data.packaged``)."""
    from pipeline.data import packaged
    from pipeline.data.prepare import idx

    folder = packaged.debian_folder(packaged.FASHION_MNIST)
    images = idx.read(str(folder / "train-images-idx3-ubyte.gz"), idx.IMAGES, 0, count)
    labels = idx.read(str(folder / "train-labels-idx1-ubyte.gz"), idx.LABELS, 0, count)
    return images, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    os.environ["PIPELINE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    sys.path.insert(0, str(ROOT))
    from pipeline import stages
    from pipeline.data import demo
    from pipeline.job.ray.cluster import LocalCluster
    from pipeline.job.spec import JobSpec
    from pipeline.job.supervisor import Job
    from pipeline.recipes.image_classifier import RECIPE

    images, labels = fashion_mnist(args.images)
    source = demo.write_idx(home / "inputs" / "fashion", "train", images, labels)
    base = RECIPE.config("demo").with_overrides({"data.input_path": str(source), "train.epochs": args.epochs,
                                                 "data.split_by": "hash", "train.log_every_steps": 50,
                                                 "launch.nproc_per_node": args.nproc})
    dataset = stages.prepare_data(base, stages.RunInfo("bench", "prep"))
    print(f"{args.images:,} 28x28 images ({dataset.rows}), {args.epochs} epochs, {args.nproc} ranks", flush=True)

    started = time.perf_counter()
    cluster = LocalCluster(cpus=os.cpu_count() or 2, grace_period_s=5)
    cluster.start(lambda line: None)
    cluster_s = time.perf_counter() - started
    runs = {"torchrun": {}, "ray": {"launch.kind": "ray"}, "ray+data": {"launch.kind": "ray", "data.reader": "ray"}}
    rows = {}
    try:
        for name, overrides in runs.items():
            if overrides:
                overrides = {**overrides, "launch.ray.address": cluster.address, "launch.ray.python": sys.executable,
                             "launch.ray.cpus_per_worker": 0.5}
            cfg = base.with_overrides(overrides)
            folder = home / "runs" / name
            folder.mkdir(parents=True)
            (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
            spec = JobSpec(entry=["-m", "pipeline.rank", "--config", str(folder / "config.json"),
                                  *(arg for uri in dataset.uris for arg in ("--dataset", uri))],
                           job_dir=folder, launch=cfg.launch, name=f"bench-{name}",
                           labels={"dag_id": "bench", "run_id": name, "task_id": "train", "try_number": "1"})
            began = time.perf_counter()
            result = Job(spec).run(lambda line: None)
            wall = time.perf_counter() - began
            throughput = result["throughput"]
            rows[name] = {"samples_per_s": throughput["samples_per_s"], "data_wait": throughput["data_wait_fraction"],
                          "train_s": result["train_wall_s"], "startup_teardown_s": round(wall - result["train_wall_s"], 1),
                          "wall_s": round(wall, 1), "val_accuracy": result["metrics"]["val_accuracy"]}
            print(f"{name:9s} {json.dumps(rows[name])}", flush=True)
    finally:
        cluster.stop()
    print(f"\n{'':24s}" + "".join(f"{name:>12s}" for name in rows))
    for key, label in (("samples_per_s", "samples/s (training)"), ("data_wait", "data-wait share"),
                       ("train_s", "training loop (s)"), ("startup_teardown_s", "start-up + teardown (s)"),
                       ("wall_s", "job wall (s)"), ("val_accuracy", "val accuracy")):
        print(f"{label:24s}" + "".join(f"{row[key]:>12,.3f}" if isinstance(row[key], float) else f"{row[key]:>12}"
                                         for row in rows.values()))
    print(f"local Ray cluster start (once per task): {cluster_s:.1f}s")
    torchrun = rows["torchrun"]["samples_per_s"]
    print(json.dumps({"images": args.images, "epochs": args.epochs, "ranks": args.nproc, "runs": rows,
                      "ray_cluster_start_s": round(cluster_s, 1),
                      "ray_over_torchrun_samples_per_s": round(rows["ray"]["samples_per_s"] / torchrun, 3),
                      "ray_data_over_torchrun_samples_per_s": round(rows["ray+data"]["samples_per_s"] / torchrun, 3)}))


if __name__ == "__main__":
    main()
