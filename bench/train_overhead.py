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
checks), timed inside each run, which that noise does not blur.

    .venv/bin/python bench/train_overhead.py --components [--rounds 100 --block 5]

measures what parts of the pipeline's step cost, inside one pair of ranks: blocks of --block steps of the pipeline's
loop (``_Loop._step``: data wait, optimizer step, step figures, checkpoint when due, preemption check) take turns
with the same steps without a part (telemetry: the compute clock's hooks and the per-rank windows written to the
heartbeat; the heartbeat: every heartbeat write; the loader: batches from memory instead of the read-ahead) and with
the minimal loop's step, on the same model, optimizer and batches. Taking turns every few steps cancels the machine's
drift; a block's time is its steps' wall time, and a variant's figure the fastest tenth of its blocks (the least
disturbed by the rest of the machine), beside its median, its main thread's CPU time per step and its data wait. A
part's cost is the pipeline's step less the step without it, as a share of the pipeline's."""

from __future__ import annotations

import argparse
import itertools
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
    parser.add_argument("--components", action="store_true", help="measure the step's parts instead (see above)")
    parser.add_argument("--rounds", type=int, default=100, help="--components: turns of every variant")
    parser.add_argument("--block", type=int, default=5, help="--components: steps per variant and turn")
    parser.add_argument("--rank-components", type=Path, help=argparse.SUPPRESS)  # a rank of --components: its folder
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_components:
        return measure_in_rank(args.config, args.dataset, args.rank_components, rounds=args.rounds, block=args.block)
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
    if args.components:
        return components(args, config_path, dataset.uri, home / "components")

    def run_minimal(i: int) -> float:
        out = home / f"minimal-{i}"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
             str(ROOT / "bench" / "minimal_ddp.py"), "--config", str(config_path), "--dataset", dataset.uri,
             "--out", str(out)],
            check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        result = json.loads((out / "result.json").read_text())
        print(f"(a) minimal DDP loop   run {i + 1}: {result['samples_per_s']:9,.0f} samples/s  "
              f"(process wall {time.perf_counter() - started:.1f}s, data-wait {result['data_wait_fraction']:.1%})",
              flush=True)
        return result["samples_per_s"]

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


def components(args, config_path: Path, dataset: str, out: Path) -> None:
    """--components: the ranks measure (``measure_in_rank``), rank 0 writes its figures, printed here."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", __file__,
         "--rank-components", str(out), "--config", str(config_path), "--dataset", dataset,
         "--rounds", str(args.rounds), "--block", str(args.block)],
        check=True, env={**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_PROGRESS_DIR": str(out / "progress")},
        stdout=subprocess.DEVNULL,
    )
    steps = json.loads((out / "components.json").read_text())
    pipeline = steps["pipeline"]
    print(f"{args.rounds} turns of {args.block} steps each; per step: wall time (fastest tenth of the turns, median), "
          f"main-thread CPU time, data wait; a part's cost: the pipeline's step less the step without it")
    for name, figures in steps.items():
        cost = "" if name == "pipeline" else (f"  -> {1 - figures['wall_s'] / pipeline['wall_s']:+6.1%} wall, "
                                              f"{1 - figures['cpu_s'] / pipeline['cpu_s']:+6.1%} cpu")
        print(f"  {name:20s} {figures['wall_s'] * 1e3:6.3f} ms (median {figures['median_s'] * 1e3:6.3f})  cpu "
              f"{figures['cpu_s'] * 1e3:6.3f} ms  data wait {figures['data_wait']:5.1%}{cost}", flush=True)


def measure_in_rank(config_path: Path, dataset: str, out: Path, *, rounds: int, block: int) -> None:
    """One rank of --components: the pipeline's loop set up as the train task sets it up, then its steps and the
    variants below taking turns (every rank runs the same turns: the steps' collectives match)."""
    import contextlib

    import torch.nn.functional as F

    from pipeline.data.read.training_data import TrainingData
    from pipeline.recipes import config_from_dict, get_recipe
    from pipeline.train import distributed
    from pipeline.train.context import RunContext
    from pipeline.train.epoch import Epoch
    from pipeline.train.loop import _Loop

    cfg = config_from_dict(json.loads(config_path.read_text()))
    dist = distributed.setup()
    ctx = RunContext(cfg, dist, out)
    loop = _Loop(cfg, get_recipe(cfg.RECIPE).load_train_spec(), ctx, TrainingData.open([dataset], out / "cache"))
    loop._start()
    loop.steps_per_epoch = loop.total_steps = 10**9  # one endless epoch: no epoch end among the measured steps

    waited = [0.0]  # seconds the steps waited for their batches

    def timed(batches):
        batches = iter(batches)
        while True:
            started = time.perf_counter()
            batch = next(batches)
            waited[0] += time.perf_counter() - started
            yield batch

    def endless():
        while True:
            yield from loop.train_loader

    kept = list(itertools.islice(endless(), 64))
    loaded, in_memory = timed(endless()), timed(kept[i % len(kept)] for i in itertools.count())
    epoch = Epoch(loaded, 0)
    heartbeat, model = ctx.heartbeat, loop.model

    def pipeline_step(batches) -> None:
        epoch.batches = batches
        loop._step(epoch)

    def minimal_step() -> None:  # bench/minimal_ddp.py's
        batch = next(loaded)
        loss = F.cross_entropy(loop.net(batch["num"], batch["cat"]), batch["label"])
        loop.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loop.optimizer.step()

    @contextlib.contextmanager
    def without(*names: str):
        hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
        if "clock" in names:
            model._forward_pre_hooks.clear()
            model._forward_hooks.clear()
        for name in {"beat", "report"} & set(names):
            setattr(heartbeat, name, lambda *args, **kwargs: None)
        try:
            yield
        finally:
            model._forward_pre_hooks.update(hooks[0])
            model._forward_hooks.update(hooks[1])
            for name in ("beat", "report"):
                heartbeat.__dict__.pop(name, None)

    variants = {
        "pipeline": (lambda: pipeline_step(loaded), ()),
        "without telemetry": (lambda: pipeline_step(loaded), ("clock", "report")),
        "without heartbeat": (lambda: pipeline_step(loaded), ("beat", "report")),
        "without the loader": (lambda: pipeline_step(in_memory), ()),
        "minimal step": (minimal_step, ("clock",)),
    }
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu, data_wait = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0.0)
    loop.net.train()
    for turn in range(rounds + 1):  # the first turn warms up
        for name, (step, parts) in variants.items():
            with without(*parts):
                started, started_cpu, started_waiting = time.perf_counter(), time.thread_time(), waited[0]
                for _ in range(block):
                    step()
                if turn:
                    wall[name].append((time.perf_counter() - started) / block)
                    cpu[name] += (time.thread_time() - started_cpu) / block / rounds
                    data_wait[name] += waited[0] - started_waiting
    ctx.checkpoints.wait()
    loop.preemption.finish()
    if dist.is_main:
        figures = {name: {"wall_s": statistics.quantiles(times, n=10)[0], "median_s": statistics.median(times),
                          "cpu_s": cpu[name], "data_wait": data_wait[name] / (sum(times) * block)}
                   for name, times in wall.items()}
        (out / "components.json").write_text(json.dumps(figures, indent=1))
    distributed.teardown(dist)


if __name__ == "__main__":
    main()
