"""The generic distributed training loop every loop-based recipe shares.

DDP or FSDP2 (``train.parallelism``: ``pipeline.train.parallel``), gradient accumulation that synchronises
only the last micro-batch, autocast, warm-up and cosine LR, checkpoints holding the model, optimizer,
scheduler, every rank's RNG and the loader's mid-epoch position (sharded ones with fsdp, which resume on any
number of ranks), heartbeats, throughput, the result file, and a preemption-safe stop (on SIGTERM every rank
stops at the same step boundary, checkpoints it and exits with ``PREEMPTED_EXIT_CODE``:
``pipeline.train.preemption``). What is the recipe's comes from its ``TrainSpec``: the model, the batch
transform (decode, augment, encode) and the loss with its per-sample metric sums.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from pipeline.config import PipelineConfig
from pipeline.data.read.training_data import TrainingData
from pipeline.stopwatch import mark, startup_line, timeline
from pipeline.train import distributed
from pipeline.train.checkpoint import capture_rng, restore_rng
from pipeline.train.context import RunContext
from pipeline.train.epoch import Epoch, Sums, plan_line, progress_line, samples
from pipeline.train.export import saved_model_files
from pipeline.train.lr import LrFactor
from pipeline.train.parallel import load_model_and_optimizer, parallelize, sharded_state
from pipeline.train.preemption import Preemption, exit_preempted
from pipeline.train.preemption import install as install_preemption
from pipeline.train.resume import latest_checkpoint, steps_done_in_epoch
from pipeline.train.spec import TrainSpec
from pipeline.train.throughput import Throughput, peak_flops, training_flops


def train(cfg: PipelineConfig, spec: TrainSpec, *, datasets: list[str], out_dir: Path) -> dict[str, Any]:
    """Train on every rank of this job; rank 0 writes the model files and ``result.json`` into ``out_dir``."""
    mark("imports_done")
    dist = distributed.setup()  # launch.backend, exported by the place
    mark("process_group_ready")
    try:
        ctx = RunContext(cfg, dist, Path(out_dir))
        mark("run_context_ready")
        # One cache per node, shared by its ranks: the job folder may be one volume that every node mounts.
        node = dist.rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        data = TrainingData.open(datasets, ctx.out_dir / "cache" / f"node-{node}")
        mark("data_opened")
        if spec.run is not None:
            started = time.perf_counter()
            outcome = spec.run(cfg, ctx, data)
            return ctx.finish(_base_result(ctx, data) | outcome | {"train_wall_s": round(time.perf_counter() - started, 3)})
        return _Loop(cfg, spec, ctx, data).run()
    finally:
        distributed.teardown(dist)


def autocast(device: torch.device, precision: str):
    """(autocast context, bf16 on?): bf16 when asked, or on ``auto`` with a GPU that supports it."""
    use_bf16 = precision == "bf16" or (
        precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16), use_bf16


def train_loader(cfg: PipelineConfig, data: TrainingData, transform):
    """The training split's loader: the published shards read in this rank (``data.reader = mds``) or Ray
    Data's stream (``ray``); either resumes from its ``state_dict``."""
    tc = cfg.train
    if cfg.data.reader == "ray":
        from pipeline.data.read.ray_data import ray_loader

        return ray_loader(data, "train", batch_size=tc.batch_size, shuffle=True, seed=tc.seed, transform=transform)
    return data.loader("train", batch_size=tc.batch_size, shuffle=True, seed=tc.seed, num_workers=tc.num_workers,
                       transform=transform)


class _Loop:
    def __init__(self, cfg: PipelineConfig, spec: TrainSpec, ctx: RunContext, data: TrainingData):
        self.cfg, self.spec, self.ctx, self.data = cfg, spec, ctx, data
        tc, dist = cfg.train, ctx.dist
        self.autocast, self.use_bf16 = autocast(dist.device, tc.precision)
        torch.manual_seed(tc.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        self.model = spec.build_model(cfg, data).to(dist.device)
        units = (lambda model: spec.shard_units(cfg, model)) if spec.shard_units else None
        self.parallel = parallelize(self.model, dist, tc, bf16=self.use_bf16, units=units)
        self.net = self.parallel.wrapped  # what the steps call
        # Sharded checkpoints are written in the background over a group of their own (gloo: host memory).
        self.checkpoint_group = torch.distributed.new_group(backend="gloo") if self.parallel.sharded else None
        torch.manual_seed(tc.seed + dist.rank)
        np.random.seed(tc.seed + dist.rank)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tc.learning_rate, weight_decay=tc.weight_decay)
        self.train_loader = train_loader(cfg, data, spec.batch_transform(cfg, data, True))
        self.val_loader = data.loader("val", batch_size=tc.batch_size, shuffle=False, seed=tc.seed,
                                      num_workers=tc.num_workers, transform=spec.batch_transform(cfg, data, False))
        micro_per_epoch = math.ceil(len(self.train_loader.dataset) / tc.batch_size)  # this rank's share
        self.steps_per_epoch = math.ceil(micro_per_epoch / tc.grad_accum_steps)
        self.total_steps = self.steps_per_epoch * tc.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, LrFactor(tc, self.total_steps))
        self.config_digest = cfg.digest()  # once: every checkpoint carries it, and hashing the config takes milliseconds
        mark("model_and_data_ready")

    def run(self) -> dict[str, Any]:
        """Every epoch left, then the result (rank 0 also writes it and the model files)."""
        self._start()
        while self.epoch < self.cfg.train.epochs:
            self._end_epoch(self._train_epoch())
        return self._finish()

    def _start(self) -> None:
        """Resume or begin (with the untrained model's baseline), the throughput meter, the run's first line, and
        the preemption handler."""
        tc, ctx, dist = self.cfg.train, self.ctx, self.ctx.dist
        resumed = self.resumed = self._resume()
        position = (resumed["step"], resumed["epoch"], resumed["in_epoch"]) if resumed else (0, 0, 0)
        self.step, self.epoch, self.in_epoch = position
        self.start_step = self.step
        flops = training_flops(self.model, getattr(self.cfg.data, "max_seq_len", None))  # per sample, or per token
        self.meter = Throughput(
            world_size=dist.world_size, flops_per_sample=None if self.spec.tokens else flops,
            flops_per_token=flops if self.spec.tokens else None, peak_flops_per_s=peak_flops(dist.device, tc.peak_tflops),
            device=dist.device)
        self.meter.watch(self.model)  # inside the DDP wrapper: its forward's buffer broadcast waits for the other ranks
        self.baseline = self._baseline() if not resumed else None
        sharding = f"fsdp over {self.parallel.units + 1} units, " if self.parallel.sharded else ""
        ctx.log(f"training on {dist.world_size} rank(s), backend {dist.backend}, device {dist.device}, {sharding}"
                f"{'bf16 autocast' if self.use_bf16 else 'fp32'}: {self.data.rows('train')} train rows, "
                + plan_line(steps_per_epoch=self.steps_per_epoch, epochs=tc.epochs, total_steps=self.total_steps,
                            world_size=dist.world_size, resumed=resumed)
                + f" (batch {tc.batch_size} x {tc.grad_accum_steps} accumulation x {dist.world_size} ranks)")
        self.metrics: dict[str, float] = resumed["metrics"] if resumed else {}  # the last finished epoch's
        # From here a SIGTERM is acted on at a step boundary; before, it ends the rank at once, with no
        # training to lose. Installed before the loaders fork their workers, which it shields.
        self.preemption = install_preemption()
        self.loop_started = time.perf_counter()
        self.upcoming = None  # the next epoch's batches, read while the last one is validated

    def _train_epoch(self) -> Epoch:
        """The steps left in this epoch: all of them but those a resumed epoch had done."""
        self.net.train()
        epoch = Epoch(self.upcoming if self.upcoming is not None else iter(self.train_loader), self.in_epoch)
        self.upcoming, self.in_epoch = None, 0  # a resumed epoch's steps are done once
        while epoch.step < self.steps_per_epoch:
            if not self._step(epoch):
                break
        return epoch

    def _step(self, epoch: Epoch) -> bool:
        """One step of ``epoch``: its batches, the optimizer step, its figures, the checkpoint when one is due and the
        ranks' agreement on a stop; False when the epoch's batches ran out first."""
        waited = time.perf_counter()  # timed inline, here and below: a context manager costs microseconds a step
        micro = epoch.micro_batches(self.cfg.train.grad_accum_steps)
        self.meter.data_wait(time.perf_counter() - waited)
        if not micro:
            return False
        step_loss, count = self._optimizer_step(micro, epoch)
        self._record_step(micro, step_loss, count)
        epoch.stopping = self._checkpoint_or_stop(epoch)
        return True

    def _optimizer_step(self, micro: list[dict[str, torch.Tensor]], epoch: Epoch) -> tuple[torch.Tensor, int]:
        """One step over ``micro``, gradients synchronised on its last micro-batch only: (the step's loss per sample,
        on the device, and its samples)."""
        device = self.ctx.dist.device
        self.optimizer.zero_grad(set_to_none=True)
        count = sum(samples(b) for b in micro)
        step_loss = None
        for i, batch in enumerate(micro):
            if device.type != "cpu":  # where batches are read already, moving them is a call per tensor for nothing
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with self.parallel.accumulating(sync=i == len(micro) - 1), self.autocast:
                loss_sum, stats = self.spec.loss(self.cfg, self.net, batch)
                loss = loss_sum.float() / count
            loss.backward()
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
            epoch.sums.add(stats)
        epoch.sums.add({"loss": step_loss * count})
        epoch.sums.count += count
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        epoch.step += 1
        return step_loss, count

    def _record_step(self, micro: list[dict[str, torch.Tensor]], step_loss: torch.Tensor, count: int) -> None:
        """The step in the meter and the heartbeat; the start-up line after the first; every ``log_every_steps``
        the window's figures: every rank's in its heartbeat, rank 0's progress line and step metrics."""
        ctx, step = self.ctx, self.step
        if step == self.start_step + 1:
            mark("first_step")
            if ctx.is_main:
                print(startup_line(), flush=True)
        self.meter.step(count, tokens=sum(self.spec.tokens(self.cfg, b) for b in micro) if self.spec.tokens else 0)
        ctx.heartbeat.beat(step, total=self.total_steps, epoch=self.epoch + 1)
        if step % self.cfg.train.log_every_steps != 0 and step != self.total_steps:
            return
        figures = self.meter.window()
        ctx.heartbeat.report(step, figures, total=self.total_steps, epoch=self.epoch + 1)  # every rank's own
        if ctx.is_main:
            loss = step_loss.item()
            progress_line(self.epoch, self.cfg.train.epochs, step, self.total_steps, self.start_step, loss, figures,
                           self.loop_started)
            ctx.metrics.log({"step_loss": loss, "lr": self.scheduler.get_last_lr()[0], **figures}, step=step)

    def _checkpoint_or_stop(self, epoch: Epoch) -> bool:
        """The periodic checkpoint when due, then whether to stop, agreed on by every rank (a collective: the same
        answer at the same step everywhere). Agreed on mid-epoch, the step is checkpointed and the rank ends here;
        at the epoch's last step, the epoch's end does both."""
        tc, step = self.cfg.train, self.step
        mid_epoch = epoch.step < self.steps_per_epoch
        periodic = bool(tc.checkpoint_every_steps and step % tc.checkpoint_every_steps == 0 and mid_epoch)
        if periodic:
            self._save(step, self.epoch, self.train_loader.state_dict(), self.metrics)
        checked = time.perf_counter()
        stopping = self.preemption.should_stop()
        self.meter.spent("preemption_check", time.perf_counter() - checked)
        if stopping and mid_epoch:
            if not periodic:
                self._save(step, self.epoch, self.train_loader.state_dict(), self.metrics)
            epoch.batches = None  # its loader workers end now rather than at interpreter exit
            self._stop_preempted(self.preemption, step)
        return stopping

    def _end_epoch(self, epoch: Epoch) -> None:
        """Validation, the epoch's metrics and its checkpoint, which names the next epoch's start; a stop agreed on
        at the epoch's last step, or asked for during validation, ends the rank there, to resume from it. After the
        last epoch the run simply finishes."""
        ctx, tc, step = self.ctx, self.cfg.train, self.step
        if self.epoch + 1 < tc.epochs:
            # The loader starts reading the next epoch now, while this one is validated and checkpointed.
            self.upcoming = iter(self.train_loader)
        train_metrics = epoch.sums.means(ctx.dist, "train_")
        ctx.heartbeat.beat(step, total=self.total_steps, epoch=self.epoch + 1, phase="validating", force=True)
        with self.meter.timed("validation"):
            self.metrics = train_metrics | self._validate(step)
        ctx.metrics.log(self.metrics | {"epoch": self.epoch + 1}, step=step)
        ctx.log(f"epoch {self.epoch + 1}/{tc.epochs} " + " ".join(f"{k} {v:.4f}" for k, v in self.metrics.items()))
        self.epoch += 1
        # At an epoch end the loader's next position is the start of the next epoch.
        loader_state = {**self.train_loader.state_dict(), "epoch": self.epoch, "sample_in_epoch": 0}
        self._save(step, self.epoch, loader_state, self.metrics)
        if self.epoch < tc.epochs and (epoch.stopping or self.preemption.should_stop(overlap=False)):
            self._stop_preempted(self.preemption, step)

    def _finish(self) -> dict[str, Any]:
        """Every rank: the last checkpoint on disk, the parameters' digests and the result; rank 0 exports the model
        and writes the result file."""
        ctx, tc, dist = self.ctx, self.cfg.train, self.ctx.dist
        self.preemption.finish()
        with self.meter.timed("checkpoint"):
            ctx.checkpoints.wait()  # the last epoch's checkpoint is on disk before the run's end is
        ctx.heartbeat.beat(self.step, total=self.total_steps, epoch=self.epoch, phase="finished", force=True)
        mark("last_step")
        train_wall_s = time.perf_counter() - self.loop_started
        # Over the same time as train_wall_s: the digests below are the run's check, not its training.
        throughput = {k: round(v, 4) for k, v in self.meter.summary().items()}
        full_state = self.parallel.full_state_dict()
        digests = self._digests(full_state)
        result = _base_result(ctx, self.data) | {
            "metrics": self.metrics, "epochs": tc.epochs, "steps": self.step, "start_step": self.start_step,
            "resumed_from": self.resumed["path"] if self.resumed else None,
            "precision": "bf16" if self.use_bf16 else "fp32", "parallelism": self.parallel.name, "throughput": throughput,
            "samples_per_s": round(throughput["samples_per_s"], 1), "train_wall_s": round(train_wall_s, 3),
            "param_digests": digests,
        }
        if self.baseline:
            result["baseline_metrics"] = self.baseline
        if dist.is_main:
            self._export(result, full_state, throughput)
        return ctx.finish(result)

    def _digests(self, full_state: dict[str, torch.Tensor]) -> list[str | None]:
        """Replicas must agree; shards are gathered into one model on rank 0, whose digest is the run's."""
        dist = self.ctx.dist
        if self.parallel.sharded:
            return [distributed.state_digest(full_state) if dist.is_main else None]
        digests = distributed.gather(dist, distributed.state_digest(full_state))
        if dist.is_main and len(set(digests)) != 1:
            print(f"WARNING: model parameters differ between ranks after training: {digests}", flush=True)
        return digests

    def _export(self, result: dict[str, Any], full_state: dict[str, torch.Tensor], throughput: dict[str, float]) -> None:
        """Rank 0: the run's throughput metrics, the model files (``result["model_files"]``) and the timeline."""
        ctx = self.ctx
        ctx.metrics.log({f"train_{k}": v for k, v in throughput.items()}, step=self.step)
        model = self._whole_model(full_state).eval()
        result["model_files"] = saved_model_files(
            ctx.out_dir, model, lambda folder: self.spec.export(self.cfg, model, self.data, folder))
        print(f"saved model files {sorted(result['model_files'])} to {ctx.out_dir}; steps {self.start_step}..{self.step}, "
              + ", ".join(f"{k} {v:,.4g}" for k, v in throughput.items()), flush=True)
        mark("model_saved")
        result["timeline"] = timeline()

    def _whole_model(self, full_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """Rank 0's whole trained model for the export: the model itself with ddp; with fsdp (or blocks wrapped for
        activation checkpointing), the recipe's model built afresh in host memory and given the gathered parameters."""
        if not self.parallel.sharded and not self.cfg.train.activation_checkpointing:
            return self.model
        model = self.spec.build_model(self.cfg, self.data)
        model.load_state_dict(full_state)
        return model

    def _save(self, step: int, epoch: int, loader_state: dict[str, Any] | None, metrics: dict[str, float]) -> None:
        """Every rank contributes its RNG state; rank 0 copies the state and writes it in the background,
        while training goes on (``CheckpointStore.save_in_background``; rank 0 waits for the write before a
        stop and at the end). With fsdp every rank writes its own shards the same way
        (``save_sharded_in_background``) and rank 0 the rest."""
        ctx = self.ctx
        with self.meter.timed("checkpoint"):
            ctx.heartbeat.beat(step, phase="checkpointing", force=True)
            rng_states = distributed.gather(ctx.dist, capture_rng())
            state = {
                "step": step, "epoch": epoch, "world_size": ctx.dist.world_size, "config_digest": self.config_digest,
                "dataset_versions": list(self.data.versions), "scheduler": self.scheduler.state_dict(),
                "loader": loader_state, "rng": rng_states, "metrics": metrics,
            }
            done = lambda path: print(f"checkpoint step {step} (epoch {epoch}) -> {path}", flush=True)  # noqa: E731
            if self.parallel.sharded:
                ctx.checkpoints.save_sharded_in_background(step, sharded_state(self.parallel, self.optimizer), state,
                                                           ctx.dist, group=self.checkpoint_group, done=done)
            elif ctx.is_main:
                state |= {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
                ctx.checkpoints.save_in_background(step, state, done=done)

    def _stop_preempted(self, preemption: Preemption, step: int) -> NoReturn:
        """Every rank, once the checkpoint of ``step`` is saved: the marker, rank 0's metrics, then the exit."""
        ctx = self.ctx
        ctx.heartbeat.beat(step, total=self.total_steps, phase="preempted", force=True)
        ctx.checkpoints.wait()
        preemption.conclude(rank=ctx.dist.rank, step=step)
        if ctx.is_main:
            ctx.metrics.close()
        exit_preempted()

    def _baseline(self) -> dict[str, float] | None:
        """The recipe's metrics of the untrained model (rank 0's), logged as ``baseline_<metric>``."""
        if self.spec.baseline is None:
            return None
        self.ctx.heartbeat.beat(0, phase="baseline", force=True)
        with torch.no_grad(), self.autocast, self.parallel.whole():
            figures = self.spec.baseline(self.cfg, self.model, self.data, self.ctx.dist)
        self.model.train()
        distributed.barrier(self.ctx.dist)
        if self.ctx.is_main:
            self.ctx.log("before training: " + ", ".join(f"{k} {v:.4f}" for k, v in figures.items()))
            self.ctx.metrics.log({f"baseline_{k}": v for k, v in figures.items()}, step=0)
        return figures

    def _resume(self) -> dict[str, Any] | None:
        """Load the newest intact checkpoint of this job, if any; every rank loads the one rank 0 chose."""
        ctx, tc = self.ctx, self.cfg.train
        chosen = latest_checkpoint(ctx, self.config_digest, self.data.versions)
        if chosen is None:
            return None
        path, state, where = chosen
        load_model_and_optimizer(self.parallel, self.optimizer, path, state)
        self.scheduler.load_state_dict(state["scheduler"])
        if state["loader"] is not None:
            self.train_loader.load_state_dict(state["loader"])
        in_epoch = steps_done_in_epoch(state, steps_per_epoch=self.steps_per_epoch, world_size=ctx.dist.world_size,
                                       tc=tc)
        # The rest of the run in this world's steps (more of them on fewer ranks); the LR schedule goes on by the
        # samples trained, whatever the steps are worth now.
        self.total_steps = state["step"] + (self.steps_per_epoch - in_epoch) + self.steps_per_epoch * (
            tc.epochs - state["epoch"] - 1)
        if state["world_size"] != ctx.dist.world_size:
            self.scheduler.lr_lambdas[0].rescale(state["step"], ctx.dist.world_size / state["world_size"])
        if state["world_size"] == ctx.dist.world_size:
            restore_rng(state["rng"][ctx.dist.rank])
        else:
            torch.manual_seed(tc.seed + ctx.dist.rank + state["step"])
            ctx.log(f"WARNING: checkpoint written by {state['world_size']} ranks, resuming on {ctx.dist.world_size}: "
                    f"random streams are reseeded, so the run is not bit-identical to an uninterrupted one")
        ctx.log(f"resuming from checkpoint {where}: step {state['step']}, epoch {state['epoch'] + 1} at its step "
                f"{in_epoch} of {self.steps_per_epoch} on {ctx.dist.world_size} rank(s)")
        return {"step": state["step"], "epoch": state["epoch"], "in_epoch": in_epoch, "path": where,
                "metrics": state["metrics"], "world_size": state["world_size"]}

    @torch.no_grad()
    def _validate(self, step: int) -> dict[str, float]:
        self.net.eval()
        sums = Sums()
        for i, batch in enumerate(self.val_loader):
            self.ctx.heartbeat.beat(step, phase=f"validating batch {i}")  # a long validation is progress, not a stall
            batch = {k: v.to(self.ctx.dist.device) for k, v in batch.items()}
            with self.autocast:
                loss_sum, stats = self.spec.loss(self.cfg, self.net, batch)
            sums.add(stats | {"loss": loss_sum.float()})
            sums.count += samples(batch)
        return sums.means(self.ctx.dist, "val_")


def _base_result(ctx: RunContext, data: TrainingData) -> dict[str, Any]:
    return {"world_size": ctx.dist.world_size, "backend": ctx.dist.backend, "dataset_version": data.versions[-1],
            "dataset_versions": data.versions, "out_dir": str(ctx.out_dir)}

