"""The generic distributed training loop every loop-based recipe shares.

DDP or FSDP2 (``train.parallelism``: ``pipeline.train.parallel``), gradient accumulation that synchronises
only the last micro-batch, autocast, warm-up and cosine LR, checkpoints holding the model, optimizer,
scheduler, every rank's RNG and the loader's mid-epoch position (sharded ones with fsdp, which resume on any
number of ranks), heartbeats,
throughput, the result file, and a preemption-safe stop (on SIGTERM every rank stops at the same step
boundary, checkpoints it and exits with ``PREEMPTED_EXIT_CODE``: ``pipeline.train.preemption``). What
is the recipe's comes from its ``TrainSpec``: the model, the batch transform (decode, augment, encode)
and the loss with its per-sample metric sums.
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
from pipeline.train.checkpoint import capture_rng, load_state, restore_rng
from pipeline.train.context import RunContext
from pipeline.train.export import saved_model_files
from pipeline.train.lr import LrFactor
from pipeline.train.parallel import load_model_and_optimizer, parallelize, sharded_state
from pipeline.train.preemption import Preemption, exit_preempted
from pipeline.train.preemption import install as install_preemption
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
        mark("model_and_data_ready")

    def run(self) -> dict[str, Any]:
        cfg, tc, ctx, dist = self.cfg, self.cfg.train, self.ctx, self.ctx.dist
        step, epoch, start_step, in_epoch = 0, 0, 0, 0
        resumed = self._resume()
        if resumed:
            step, epoch, start_step, in_epoch = resumed["step"], resumed["epoch"], resumed["step"], resumed["in_epoch"]
        flops = training_flops(self.model, getattr(cfg.data, "max_seq_len", None))  # per sample, or per token
        meter = self.meter = Throughput(
            world_size=dist.world_size, flops_per_sample=None if self.spec.tokens else flops,
            flops_per_token=flops if self.spec.tokens else None, peak_flops_per_s=peak_flops(dist.device, tc.peak_tflops),
            device=dist.device)
        meter.watch(self.model)  # inside the DDP wrapper: its forward's buffer broadcast waits for the other ranks
        baseline = self._baseline() if not resumed else None
        sharding = f"fsdp over {self.parallel.units + 1} units, " if self.parallel.sharded else ""
        ctx.log(f"training on {dist.world_size} rank(s), backend {dist.backend}, device {dist.device}, {sharding}"
                f"{'bf16 autocast' if self.use_bf16 else 'fp32'}: {self.data.rows('train')} train rows, "
                f"{self.steps_per_epoch} steps/epoch x {tc.epochs} epochs = {self.total_steps} steps "
                f"(batch {tc.batch_size} x {tc.grad_accum_steps} accumulation x {dist.world_size} ranks)"
                + (f"; resumed from step {start_step} (epoch {epoch + 1})" if resumed else ""))

        metrics: dict[str, float] = resumed["metrics"] if resumed else {}  # the last finished epoch's
        # From here a SIGTERM is acted on at a step boundary; before, it ends the rank at once, with no
        # training to lose. Installed before the loaders fork their workers, which it shields.
        preemption = install_preemption()
        loop_started = time.perf_counter()
        upcoming = None  # the next epoch's batches, read while the last one is validated
        while epoch < tc.epochs:
            self.net.train()
            # Running sums stay on the device: a .item() per step would make every step wait for it.
            sums: dict[str, torch.Tensor] = {}
            count = 0
            batches = upcoming if upcoming is not None else iter(self.train_loader)
            upcoming = None
            step_in_epoch, in_epoch = in_epoch, 0  # a resumed epoch's steps already done, then none
            stopping = False
            while step_in_epoch < self.steps_per_epoch:
                waited = time.perf_counter()
                micro = _next_micro_batches(batches, tc.grad_accum_steps)
                meter.data_wait(time.perf_counter() - waited)
                if not micro:
                    break
                self.optimizer.zero_grad(set_to_none=True)
                samples = sum(_samples(b) for b in micro)
                step_loss = torch.zeros((), device=dist.device)
                for i, batch in enumerate(micro):
                    batch = {k: v.to(dist.device, non_blocking=True) for k, v in batch.items()}
                    with self.parallel.accumulating(sync=i == len(micro) - 1), self.autocast:
                        loss_sum, stats = self.spec.loss(self.cfg, self.net, batch)
                        loss = loss_sum.float() / samples
                    loss.backward()
                    step_loss += loss.detach()
                    _accumulate(sums, stats)
                _accumulate(sums, {"loss": step_loss * samples})
                count += samples
                self.optimizer.step()
                self.scheduler.step()
                step += 1
                step_in_epoch += 1
                if step == start_step + 1:
                    mark("first_step")
                    if dist.is_main:
                        print(startup_line(), flush=True)
                meter.step(samples, tokens=sum(self.spec.tokens(self.cfg, b) for b in micro) if self.spec.tokens else 0)
                ctx.heartbeat.beat(step, total=self.total_steps, epoch=epoch + 1)
                if step % tc.log_every_steps == 0 or step == self.total_steps:
                    figures = meter.window()
                    ctx.heartbeat.report(step, figures, total=self.total_steps, epoch=epoch + 1)  # every rank's own
                    if dist.is_main:
                        _progress_line(epoch, tc.epochs, step, self.total_steps, start_step, step_loss.item(),
                                       figures, loop_started)
                        ctx.metrics.log({"step_loss": step_loss.item(), "lr": self.scheduler.get_last_lr()[0],
                                         **figures}, step=step)
                mid_epoch = step_in_epoch < self.steps_per_epoch
                periodic = bool(tc.checkpoint_every_steps and step % tc.checkpoint_every_steps == 0 and mid_epoch)
                if periodic:
                    self._save(step, epoch, self.train_loader.state_dict(), metrics)
                with meter.timed("preemption_check"):  # a collective: the same answer at the same step on every rank
                    stopping = preemption.should_stop()
                if stopping and mid_epoch:
                    if not periodic:
                        self._save(step, epoch, self.train_loader.state_dict(), metrics)
                    del batches  # its loader workers end now rather than at interpreter exit
                    self._stop_preempted(preemption, step)
            if epoch + 1 < tc.epochs:
                # The loader starts reading the next epoch now, while this one is validated and checkpointed
                # (the epoch-end checkpoint names the next epoch's start itself, below).
                upcoming = iter(self.train_loader)
            train_metrics = _means(dist, sums, count, "train_")
            ctx.heartbeat.beat(step, total=self.total_steps, epoch=epoch + 1, phase="validating", force=True)
            with meter.timed("validation"):
                metrics = train_metrics | self._validate(step)
            ctx.metrics.log(metrics | {"epoch": epoch + 1}, step=step)
            ctx.log(f"epoch {epoch + 1}/{tc.epochs} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            epoch += 1
            # At an epoch end the loader's next position is the start of the next epoch.
            loader_state = {**self.train_loader.state_dict(), "epoch": epoch, "sample_in_epoch": 0}
            self._save(step, epoch, loader_state, metrics)
            # A stop agreed on at the epoch's last step, or asked for during validation, resumes from the
            # epoch-end checkpoint just written. After the last epoch the run simply finishes.
            if epoch < tc.epochs and (stopping or preemption.should_stop(overlap=False)):
                self._stop_preempted(preemption, step)
        preemption.finish()
        with meter.timed("checkpoint"):
            ctx.checkpoints.wait()  # the last epoch's checkpoint is on disk before the run's end is
        ctx.heartbeat.beat(step, total=self.total_steps, epoch=epoch, phase="finished", force=True)
        mark("last_step")

        train_wall_s = time.perf_counter() - loop_started
        # Replicas must agree; shards are gathered into one model on rank 0, whose digest is the run's.
        full_state = self.parallel.full_state_dict()
        if self.parallel.sharded:
            digests = [distributed.state_digest(full_state) if dist.is_main else None]
        else:
            digests = distributed.gather(dist, distributed.state_digest(full_state))
            if dist.is_main and len(set(digests)) != 1:
                print(f"WARNING: model parameters differ between ranks after training: {digests}", flush=True)
        throughput = {k: round(v, 4) for k, v in meter.summary().items()}
        result = _base_result(ctx, self.data) | {
            "metrics": metrics, "epochs": tc.epochs, "steps": step, "start_step": start_step,
            "resumed_from": resumed["path"] if resumed else None,
            "precision": "bf16" if self.use_bf16 else "fp32", "parallelism": self.parallel.name, "throughput": throughput,
            "samples_per_s": round(throughput["samples_per_s"], 1), "train_wall_s": round(train_wall_s, 3),
            "param_digests": digests,
        }
        if baseline:
            result["baseline_metrics"] = baseline
        if dist.is_main:
            ctx.metrics.log({f"train_{k}": v for k, v in throughput.items()}, step=step)
            model = self._whole_model(full_state).eval()
            result["model_files"] = saved_model_files(
                ctx.out_dir, model, lambda folder: self.spec.export(cfg, model, self.data, folder))
            print(f"saved model files {sorted(result['model_files'])} to {ctx.out_dir}; steps {start_step}..{step}, "
                  + ", ".join(f"{k} {v:,.4g}" for k, v in throughput.items()), flush=True)
            mark("model_saved")
            result["timeline"] = timeline()
        return ctx.finish(result)

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
                "step": step, "epoch": epoch, "world_size": ctx.dist.world_size, "config_digest": self.cfg.digest(),
                "scheduler": self.scheduler.state_dict(), "loader": loader_state, "rng": rng_states, "metrics": metrics,
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
        ctx, cfg = self.ctx, self.cfg
        found = None
        if ctx.is_main:
            found = ctx.checkpoints.load_latest()
            if found and found.state.get("config_digest") != cfg.digest():
                print(f"WARNING: ignoring checkpoints in {ctx.checkpoints.location}: written with config digest "
                      f"{found.state.get('config_digest')}, this run's is {cfg.digest()}", flush=True)
                found = None
        name = distributed.broadcast_object(ctx.dist, found.path.name if found else None)
        if name is None:
            return None
        path = found.path if found else ctx.checkpoints.local_copy(name)  # on this node: a download on an object store
        state, chosen = (found.state if found else load_state(path)), ctx.checkpoints.where(name)
        load_model_and_optimizer(self.parallel, self.optimizer, path, state)
        self.scheduler.load_state_dict(state["scheduler"])
        if state["loader"] is not None:
            self.train_loader.load_state_dict(state["loader"])
        in_epoch = self._steps_done_in_epoch(state)
        # The rest of the run in this world's steps (more of them on fewer ranks); the LR schedule goes on by the
        # samples trained, whatever the steps are worth now.
        tc = cfg.train
        self.total_steps = state["step"] + (self.steps_per_epoch - in_epoch) + self.steps_per_epoch * (
            tc.epochs - state["epoch"] - 1)
        if state["world_size"] != ctx.dist.world_size:
            self.scheduler.lr_lambdas[0].rescale(state["step"], ctx.dist.world_size / state["world_size"])
        if state["world_size"] == ctx.dist.world_size:
            restore_rng(state["rng"][ctx.dist.rank])
        else:
            torch.manual_seed(cfg.train.seed + ctx.dist.rank + state["step"])
            ctx.log(f"WARNING: checkpoint written by {state['world_size']} ranks, resuming on {ctx.dist.world_size}: "
                    f"random streams are reseeded, so the run is not bit-identical to an uninterrupted one")
        ctx.log(f"resuming from checkpoint {chosen}: step {state['step']}, epoch {state['epoch'] + 1} at its step "
                f"{in_epoch} of {self.steps_per_epoch} on {ctx.dist.world_size} rank(s)")
        return {"step": state["step"], "epoch": state["epoch"], "in_epoch": in_epoch, "path": chosen,
                "metrics": state["metrics"]}

    def _steps_done_in_epoch(self, state: dict[str, Any]) -> int:
        """Optimizer steps of the checkpoint's epoch already trained, in this world's steps: from the loader's
        position (samples of the epoch over all ranks), so a resume on another number of ranks (an elastic
        restart after losing a node) continues at the same sample; from the step count without one."""
        loader, tc = state.get("loader") or {}, self.cfg.train
        if "sample_in_epoch" not in loader:
            return state["step"] - state["epoch"] * self.steps_per_epoch
        per_step = self.ctx.dist.world_size * tc.batch_size * tc.grad_accum_steps
        return min(self.steps_per_epoch, int(loader["sample_in_epoch"]) // per_step)

    @torch.no_grad()
    def _validate(self, step: int) -> dict[str, float]:
        self.net.eval()
        sums: dict[str, torch.Tensor] = {}
        count = 0
        for i, batch in enumerate(self.val_loader):
            self.ctx.heartbeat.beat(step, phase=f"validating batch {i}")  # a long validation is progress, not a stall
            batch = {k: v.to(self.ctx.dist.device) for k, v in batch.items()}
            with self.autocast:
                loss_sum, stats = self.spec.loss(self.cfg, self.net, batch)
            _accumulate(sums, stats | {"loss": loss_sum.float()})
            count += _samples(batch)
        return _means(self.ctx.dist, sums, count, "val_")


def _base_result(ctx: RunContext, data: TrainingData) -> dict[str, Any]:
    return {"world_size": ctx.dist.world_size, "backend": ctx.dist.backend, "dataset_version": data.versions[-1],
            "dataset_versions": data.versions, "out_dir": str(ctx.out_dir)}


def _samples(batch: dict[str, torch.Tensor]) -> int:
    return int(next(iter(batch.values())).shape[0])


def _accumulate(sums: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    for key, value in stats.items():
        value = value.detach().to(torch.float64)
        sums[key] = sums[key] + value if key in sums else value


def _means(dist, sums: dict[str, torch.Tensor], count: int, prefix: str) -> dict[str, float]:
    """Per-sample means of every rank's sums (one all-reduce)."""
    keys = sorted(sums)
    totals = distributed.all_reduce_sum(dist, [float(sums[k].item()) for k in keys] + [float(count)])
    n = max(totals[-1], 1.0)
    ordered = ["loss"] + [k for k in keys if k != "loss"]
    values = dict(zip(keys, totals[:-1]))
    return {f"{prefix}{k}": values[k] / n for k in ordered if k in values}


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
