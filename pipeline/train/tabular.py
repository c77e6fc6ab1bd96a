"""The DDP training loop of the tabular MLP: streams each rank's share of the MDS splits, checkpoints, resumes."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from pipeline.config import PipelineConfig, TrainConfig
from pipeline.data.reading import TrainingData
from pipeline.recipes.tabular_mlp.model import ModelSpec, TabularMLP
from pipeline.train import distributed
from pipeline.train.checkpoint import CheckpointStore, capture_rng, restore_rng
from pipeline.train.progress import Heartbeat
from pipeline.train.throughput import Throughput, peak_flops

log = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
SPEC_FILE = "model_spec.json"
RESULT_FILE = "result.json"
UNSENT_FILE = "unsent_metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"


class _Tracker:
    """Rank 0's metrics, sent to the MLflow run named by ``MLFLOW_RUN_ID`` without blocking training."""

    def __init__(self, enabled: bool):
        self.run_id = os.environ.get("MLFLOW_RUN_ID") if enabled else None
        self._logger = None
        if self.run_id:
            from pipeline.registry.buffered import BufferedMetricLogger, mlflow_sender
            from pipeline.registry.tracking import client

            self._logger = BufferedMetricLogger(mlflow_sender(client(), self.run_id))

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self._logger:
            self._logger.log(values, step)

    def close(self, timeout_s: float, spill_path: Path) -> int:
        return self._logger.close(timeout_s, spill_path) if self._logger else 0


def train(cfg: PipelineConfig, *, datasets: list[str], out_dir: Path) -> dict[str, Any]:
    """Train on every rank of this job; rank 0 writes the model and ``result.json`` into ``out_dir``."""
    ctx = distributed.setup(cfg.launch.backend)
    try:
        return _train(cfg, ctx, datasets, Path(out_dir))
    finally:
        distributed.teardown(ctx)


def _autocast(ctx, tc: TrainConfig):
    use_bf16 = tc.precision == "bf16" or (
        tc.precision == "auto" and ctx.device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    return torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16, enabled=use_bf16), use_bf16


def _train(cfg: PipelineConfig, ctx, datasets: list[str], out_dir: Path) -> dict[str, Any]:
    from streaming import StreamingDataLoader

    from pipeline.launch.shm import clean_stale_shared_memory

    heartbeat = Heartbeat.from_env(ctx.rank)
    if ctx.local_rank == 0:
        clean_stale_shared_memory()  # what ranks of a previous (restarted) attempt left behind
    distributed.barrier(ctx)
    tc = cfg.train
    data = TrainingData.open(datasets, out_dir / "cache")  # cache shared by the ranks of a node
    prep = data.preprocessing
    torch.manual_seed(tc.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    spec = ModelSpec(
        num_numeric=len(prep["mean"]), cardinalities=[len(prep["vocab"][c]) for c in prep["categorical_columns"]],
        num_classes=len(prep["label_classes"]), hidden_sizes=list(tc.hidden_sizes), dropout=tc.dropout,
    )
    model = TabularMLP(spec, prep["mean"], prep["std"]).to(ctx.device)
    ddp = DistributedDataParallel(model) if ctx.enabled else model
    torch.manual_seed(tc.seed + ctx.rank)
    np.random.seed(tc.seed + ctx.rank)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=tc.learning_rate, weight_decay=tc.weight_decay)
    micro_batch = tc.batch_size
    train_set = data.dataset("train", shuffle=True, seed=tc.seed, batch_size=micro_batch)
    # Loaders draw a base seed at every iter(); from their own generators, so that the global stream
    # (dropout) is the same after a mid-epoch resume as in an uninterrupted run.
    train_loader = StreamingDataLoader(train_set, batch_size=micro_batch, num_workers=tc.num_workers,
                                       collate_fn=data.collate, generator=torch.Generator().manual_seed(tc.seed))
    val_loader = StreamingDataLoader(data.dataset("val", shuffle=False, seed=tc.seed, batch_size=micro_batch),
                                     batch_size=micro_batch, num_workers=tc.num_workers, collate_fn=data.collate,
                                     generator=torch.Generator().manual_seed(tc.seed))
    micro_per_epoch = math.ceil(len(train_set) / micro_batch)  # len() is this rank's share
    steps_per_epoch = math.ceil(micro_per_epoch / tc.grad_accum_steps)
    total_steps = steps_per_epoch * tc.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _LrFactor(tc, total_steps))
    store = CheckpointStore(out_dir / CHECKPOINT_DIR, keep=tc.keep_checkpoints)
    autocast, use_bf16 = _autocast(ctx, tc)

    step, epoch, start_step = 0, 0, 0
    resumed = _resume(ctx, store, cfg, model, optimizer, scheduler, train_loader)
    if resumed:
        step, epoch, start_step = resumed["step"], resumed["epoch"], resumed["step"]
    tracker = _Tracker(ctx.is_main)
    flops_per_sample = 6.0 * sum(p.numel() for p in model.parameters())  # forward + backward, dense layers
    meter = Throughput(world_size=ctx.world_size, flops_per_sample=flops_per_sample,
                       peak_flops_per_s=peak_flops(ctx.device))
    if ctx.is_main:
        print(f"training on {ctx.world_size} rank(s), backend {ctx.backend}, device {ctx.device}, "
              f"{'bf16 autocast' if use_bf16 else 'fp32'}: {data.rows('train')} train rows, "
              f"{steps_per_epoch} steps/epoch x {tc.epochs} epochs = {total_steps} steps "
              f"(batch {micro_batch} x {tc.grad_accum_steps} accumulation x {ctx.world_size} ranks)"
              + (f"; resumed from step {start_step} (epoch {epoch + 1})" if resumed else ""), flush=True)

    metrics: dict[str, float] = resumed["metrics"] if resumed else {}  # the last finished epoch's
    loop_started = time.perf_counter()
    while epoch < tc.epochs:
        ddp.train()
        # Running sums stay on the device: a .item() per step would make every step wait for the device.
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        correct = torch.zeros((), dtype=torch.int64, device=ctx.device)
        count = 0
        batches = iter(train_loader)
        step_in_epoch = step - epoch * steps_per_epoch
        while step_in_epoch < steps_per_epoch:
            waited = time.perf_counter()
            micro = _next_micro_batches(batches, tc.grad_accum_steps)
            meter.data_wait(time.perf_counter() - waited)
            if not micro:
                break
            optimizer.zero_grad(set_to_none=True)
            samples = sum(b["label"].shape[0] for b in micro)
            step_loss = torch.zeros((), device=ctx.device)
            for i, batch in enumerate(micro):
                num, cat, label = (batch[k].to(ctx.device, non_blocking=True) for k in ("num", "cat", "label"))
                sync = i == len(micro) - 1 or not ctx.enabled
                with (contextlib.nullcontext() if sync else ddp.no_sync()), autocast:
                    logits = ddp(num, cat)
                    loss = F.cross_entropy(logits.float(), label, reduction="sum") / samples
                loss.backward()
                step_loss += loss.detach()
                correct += (logits.argmax(1) == label).sum()
            loss_sum += step_loss * samples
            count += samples
            optimizer.step()
            scheduler.step()
            step += 1
            step_in_epoch += 1
            meter.step(samples)
            heartbeat.beat(step, total=total_steps, epoch=epoch + 1)
            if step % tc.log_every_steps == 0 or step == total_steps:
                figures = meter.window()
                if ctx.is_main:
                    _progress_line(epoch, tc.epochs, step, total_steps, start_step, step_loss.item(), figures, loop_started)
                    tracker.metrics({"step_loss": step_loss.item(), "lr": scheduler.get_last_lr()[0], **figures}, step=step)
            if tc.checkpoint_every_steps and step % tc.checkpoint_every_steps == 0 and step_in_epoch < steps_per_epoch:
                _save(ctx, store, cfg, step, epoch, model, optimizer, scheduler, train_loader.state_dict(), heartbeat, metrics)
        loss_sum, correct, count = distributed.all_reduce_sum(ctx, [loss_sum.item(), float(correct.item()), count])
        heartbeat.beat(step, total=total_steps, epoch=epoch + 1, phase="validating", force=True)
        val_loss, val_accuracy = _validate(ctx, ddp, val_loader, autocast, heartbeat, step)
        metrics = {
            "train_loss": loss_sum / max(count, 1), "train_accuracy": correct / max(count, 1),
            "val_loss": val_loss, "val_accuracy": val_accuracy,
        }
        tracker.metrics(metrics | {"epoch": epoch + 1}, step=step)
        if ctx.is_main:
            print(f"epoch {epoch + 1}/{tc.epochs} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
        epoch += 1
        # At an epoch end the loader's next position is the start of the next epoch.
        loader_state = {**train_loader.state_dict(), "epoch": epoch, "sample_in_epoch": 0}
        _save(ctx, store, cfg, step, epoch, model, optimizer, scheduler, loader_state, heartbeat, metrics)

    train_wall_s = time.perf_counter() - loop_started
    digests = distributed.gather(ctx, distributed.state_digest(model))
    if ctx.is_main and len(set(digests)) != 1:
        print(f"WARNING: model parameters differ between ranks after training: {digests}", flush=True)
    throughput = {k: round(v, 4) for k, v in meter.summary().items()}
    result = {
        "metrics": metrics,
        "epochs": tc.epochs,
        "steps": step,
        "start_step": start_step,
        "resumed_from": resumed["path"] if resumed else None,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "precision": "bf16" if use_bf16 else "fp32",
        "throughput": throughput,
        "samples_per_s": round(throughput["samples_per_s"], 1),
        "train_wall_s": round(train_wall_s, 3),
        "model_path": str(out_dir / MODEL_FILE),
        "spec_path": str(out_dir / SPEC_FILE),
        "dataset_version": data.versions[-1],
        "dataset_versions": data.versions,
        "param_digests": digests,
        "mlflow_run_id": tracker.run_id,
        "unsent_metrics_path": str(out_dir / UNSENT_FILE),
    }
    if ctx.is_main:
        tracker.metrics({f"train_{k}": v for k, v in throughput.items()}, step=step)
        result["unsent_metrics"] = tracker.close(tc.metrics_flush_timeout_s, out_dir / UNSENT_FILE)
        torch.save(model.state_dict(), out_dir / MODEL_FILE)
        (out_dir / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=2))
        tmp = out_dir / f".{RESULT_FILE}.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, out_dir / RESULT_FILE)  # the result appears only once the model is saved
        print(f"saved model to {out_dir / MODEL_FILE}; steps {start_step}..{step}, "
              + ", ".join(f"{k} {v:,.4g}" for k, v in throughput.items()), flush=True)
    return result


class _LrFactor:
    """Picklable LR multiplier (LambdaLR keeps a callable object's state in its state_dict)."""

    def __init__(self, tc: TrainConfig, total_steps: int):
        self.schedule, self.warmup_steps, self.total_steps = tc.lr_schedule, tc.warmup_steps, total_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "cosine":
            progress = (step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0


def _next_micro_batches(batches, count: int) -> list[dict[str, torch.Tensor]]:
    micro = []
    for _ in range(count):
        try:
            micro.append(next(batches))
        except StopIteration:
            break
    return micro


def _progress_line(epoch, epochs, step, total_steps, start_step, loss, figures, loop_started) -> None:
    elapsed = time.perf_counter() - loop_started
    eta = (total_steps - step) * elapsed / max(step - start_step, 1)
    extra = f" mfu {figures['mfu']:.1%}" if "mfu" in figures else ""
    extra += f" {figures['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in figures else ""
    print(f"epoch {epoch + 1}/{epochs} step {step}/{total_steps} loss {loss:.4f} "
          f"{figures['samples_per_s']:,.0f} samples/s step {figures['step_time_s'] * 1e3:.1f}ms "
          f"data-wait {figures['data_wait_fraction']:.0%}{extra} eta {eta:.0f}s", flush=True)


def _save(ctx, store: CheckpointStore, cfg: PipelineConfig, step: int, epoch: int, model, optimizer, scheduler,
          loader_state: dict[str, Any] | None, heartbeat: Heartbeat, metrics: dict[str, float]) -> None:
    """Every rank contributes its RNG state; rank 0 writes the checkpoint; all wait until it is on disk."""
    heartbeat.beat(step, phase="checkpointing", force=True)
    rng_states = distributed.gather(ctx, capture_rng())
    if ctx.is_main:
        state = {
            "step": step, "epoch": epoch, "world_size": ctx.world_size, "config_digest": cfg.digest(),
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "loader": loader_state, "rng": rng_states, "metrics": metrics,
        }
        path = store.save(step, state)
        print(f"checkpoint step {step} (epoch {epoch}) -> {path}", flush=True)
    distributed.barrier(ctx)


def _resume(ctx, store: CheckpointStore, cfg: PipelineConfig, model, optimizer, scheduler, loader) -> dict[str, Any] | None:
    """Load the newest intact checkpoint of this job, if any; every rank loads the one rank 0 chose."""
    found = None
    if ctx.is_main:
        found = store.load_latest()
        if found and found.state.get("config_digest") != cfg.digest():
            print(f"WARNING: ignoring checkpoints in {store.root}: written with config digest "
                  f"{found.state.get('config_digest')}, this run's is {cfg.digest()}", flush=True)
            found = None
    chosen = distributed.broadcast_object(ctx, str(found.path) if found else None)
    if chosen is None:
        return None
    from pipeline.train.checkpoint import load_state

    state = found.state if found else load_state(Path(chosen))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state["loader"] is not None:
        loader.load_state_dict(state["loader"])
    if state["world_size"] == ctx.world_size:
        restore_rng(state["rng"][ctx.rank])
    else:
        torch.manual_seed(cfg.train.seed + ctx.rank + state["step"])
        if ctx.is_main:
            print(f"WARNING: checkpoint written by {state['world_size']} ranks, resuming on {ctx.world_size}: "
                  f"random streams are reseeded, so the run is not bit-identical to an uninterrupted one", flush=True)
    if ctx.is_main:
        print(f"resuming from checkpoint {chosen}: step {state['step']}, epoch {state['epoch']}", flush=True)
    return {"step": state["step"], "epoch": state["epoch"], "path": chosen, "metrics": state["metrics"]}


@torch.no_grad()
def _validate(ctx, model, loader, autocast, heartbeat: Heartbeat, step: int) -> tuple[float, float]:
    model.eval()
    loss_sum = correct = count = 0.0
    for i, batch in enumerate(loader):
        heartbeat.beat(step, phase=f"validating batch {i}")  # a long validation is progress, not a stall
        num, cat, label = (batch[k].to(ctx.device) for k in ("num", "cat", "label"))
        with autocast:
            logits = model(num, cat)
        loss_sum += F.cross_entropy(logits.float(), label, reduction="sum").item()
        correct += (logits.argmax(1) == label).sum().item()
        count += label.shape[0]
    loss_sum, correct, count = distributed.all_reduce_sum(ctx, [loss_sum, correct, count])
    return loss_sum / max(count, 1), correct / max(count, 1)
