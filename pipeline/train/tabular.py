"""The DDP training loop of the tabular MLP: each rank streams its share of the MDS splits."""

from __future__ import annotations

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

from pipeline.config import PipelineConfig
from pipeline.data import local_path
from pipeline.data.tabular import read_manifest, read_preprocessing
from pipeline.recipes.tabular_mlp.model import ModelSpec, TabularMLP
from pipeline.train import distributed

log = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
SPEC_FILE = "model_spec.json"
RESULT_FILE = "result.json"
UNSENT_FILE = "unsent_metrics.jsonl"


def _loader(dataset_dir: Path, split: str, cache_dir: Path, *, batch_size: int, shuffle: bool, seed: int):
    from streaming import StreamingDataLoader, StreamingDataset

    # The published version is the remote and each job gets its own local cache: two jobs reading
    # one version at once would otherwise collide on streaming's per-directory shared memory.
    dataset = StreamingDataset(
        remote=str(dataset_dir / split), local=str(cache_dir / split), split=None, shuffle=shuffle,
        shuffle_seed=seed, batch_size=batch_size,
    )
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=0, collate_fn=_collate)


def _collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    # np.stack copies, so the tensors own writable memory (streaming hands out read-only views).
    return {key: torch.from_numpy(np.stack([np.asarray(s[key]) for s in samples])) for key in samples[0]}


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


def train(cfg: PipelineConfig, *, dataset: str, out_dir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    ctx = distributed.setup(cfg.launch.backend)
    try:
        return _train(cfg, ctx, local_path(dataset), Path(out_dir), started)
    finally:
        distributed.teardown(ctx)


def _train(cfg: PipelineConfig, ctx, dataset_dir: Path, out_dir: Path, started: float) -> dict[str, Any]:
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()  # holds a barrier: every rank calls it
    tc = cfg.train
    torch.manual_seed(tc.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    prep = read_preprocessing(dataset_dir)
    manifest = read_manifest(dataset_dir)
    spec = ModelSpec(
        num_numeric=len(prep["mean"]), cardinalities=[len(prep["vocab"][c]) for c in prep["categorical_columns"]],
        num_classes=len(prep["label_classes"]), hidden_sizes=list(tc.hidden_sizes), dropout=tc.dropout,
    )
    model = TabularMLP(spec, prep["mean"], prep["std"]).to(ctx.device)
    ddp = DistributedDataParallel(model) if ctx.enabled else model
    torch.manual_seed(tc.seed + ctx.rank)
    np.random.seed(tc.seed + ctx.rank)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=tc.learning_rate, weight_decay=tc.weight_decay)
    cache_dir = out_dir / "cache"  # shared by the ranks of a node, as streaming expects
    train_loader = _loader(dataset_dir, "train", cache_dir, batch_size=tc.batch_size, shuffle=True, seed=tc.seed)
    val_loader = _loader(dataset_dir, "val", cache_dir, batch_size=tc.batch_size, shuffle=False, seed=tc.seed)
    steps_per_epoch = math.ceil(len(train_loader.dataset) / tc.batch_size)
    total_steps = steps_per_epoch * tc.epochs
    tracker = _Tracker(ctx.is_main)
    if ctx.is_main:
        print(f"training on {ctx.world_size} rank(s), backend {ctx.backend}, device {ctx.device}: "
              f"{manifest['splits']['train']} train rows, {steps_per_epoch} steps/epoch, {tc.epochs} epochs",
              flush=True)

    step = 0
    metrics: dict[str, float] = {}
    train_started = time.perf_counter()
    samples_seen = 0
    for epoch in range(tc.epochs):
        ddp.train()
        loss_sum = correct = count = 0.0
        for batch in train_loader:
            num, cat, label = (batch[k].to(ctx.device) for k in ("num", "cat", "label"))
            logits = ddp(num.float(), cat.long())
            loss = F.cross_entropy(logits, label.long())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            n = label.shape[0]
            samples_seen += n
            loss_sum += loss.item() * n
            correct += (logits.argmax(1) == label).sum().item()
            count += n
            if ctx.is_main and (step % tc.log_every_steps == 0 or step == total_steps):
                elapsed = time.perf_counter() - train_started
                rate = samples_seen * ctx.world_size / max(elapsed, 1e-9)
                eta = (total_steps - step) * elapsed / step
                print(f"epoch {epoch + 1}/{tc.epochs} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"{rate:,.0f} samples/s eta {eta:.0f}s", flush=True)
                tracker.metrics({"step_loss": loss.item(), "samples_per_s": rate}, step=step)
        loss_sum, correct, count = distributed.all_reduce_sum(ctx, [loss_sum, correct, count])
        val_loss, val_accuracy = _validate(ctx, ddp, val_loader)
        metrics = {
            "train_loss": loss_sum / max(count, 1), "train_accuracy": correct / max(count, 1),
            "val_loss": val_loss, "val_accuracy": val_accuracy,
        }
        tracker.metrics(metrics | {"epoch": epoch + 1}, step=step)
        if ctx.is_main:
            print(f"epoch {epoch + 1}/{tc.epochs} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)

    train_wall_s = time.perf_counter() - train_started
    digests = distributed.gather(ctx, distributed.state_digest(model))
    if ctx.is_main and len(set(digests)) != 1:
        print(f"WARNING: model parameters differ between ranks after training: {digests}", flush=True)
    samples_per_s = samples_seen * ctx.world_size / max(train_wall_s, 1e-9)
    result = {
        "metrics": metrics,
        "epochs": tc.epochs,
        "steps": step,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "samples_per_s": round(samples_per_s, 1),
        "train_wall_s": round(train_wall_s, 3),
        "model_path": str(out_dir / MODEL_FILE),
        "spec_path": str(out_dir / SPEC_FILE),
        "dataset_version": manifest["version"],
        "param_digests": digests,
        "mlflow_run_id": tracker.run_id,
        "unsent_metrics_path": str(out_dir / UNSENT_FILE),
    }
    if ctx.is_main:
        tracker.metrics({"train_samples_per_s": samples_per_s}, step=step)
        result["unsent_metrics"] = tracker.close(tc.metrics_flush_timeout_s, out_dir / UNSENT_FILE)
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), out_dir / MODEL_FILE)
        (out_dir / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=2))
        tmp = out_dir / f".{RESULT_FILE}.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, out_dir / RESULT_FILE)  # the result appears only once the model is saved
        print(f"saved model to {out_dir / MODEL_FILE} ({samples_per_s:,.0f} samples/s)", flush=True)
    return result


@torch.no_grad()
def _validate(ctx, model, loader) -> tuple[float, float]:
    model.eval()
    loss_sum = correct = count = 0.0
    for batch in loader:
        num, cat, label = (batch[k].to(ctx.device) for k in ("num", "cat", "label"))
        logits = model(num.float(), cat.long())
        loss_sum += F.cross_entropy(logits, label.long(), reduction="sum").item()
        correct += (logits.argmax(1) == label).sum().item()
        count += label.shape[0]
    loss_sum, correct, count = distributed.all_reduce_sum(ctx, [loss_sum, correct, count])
    return loss_sum / max(count, 1), correct / max(count, 1)
