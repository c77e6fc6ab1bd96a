"""The run context for trainers that bring their own loop: Hugging Face ``Trainer`` and Lightning callbacks.

A recipe's ``TrainSpec.run`` (or any script under the supervisor) hands its trainer a callback bound to the
``RunContext``: its checkpoints land where the supervisor resumes from, its steps feed the stall
watchdog's heartbeat, and rank 0's logs reach MLflow through the metrics sink (the job folder's file the
task relays).

- Hugging Face: ``Trainer(output_dir=ctx.checkpoint_dir, callbacks=[huggingface_callback(ctx)])``,
  resumed with ``resume_from_checkpoint=last_huggingface_checkpoint(ctx)``. On a CPU the ``TrainingArguments``
  need ``use_cpu=True``: without it the Trainer joins no process group there, and each rank would train a
  model of its own and write the same checkpoint files as the others; the callback refuses that (``ConfigError``)
  when the Trainer is created.
- Lightning: ``callback = lightning_callback(ctx, ...)``, then ``Trainer(callbacks=[callback],
  plugins=[callback.checkpoint_io], enable_checkpointing=False)``, resumed with
  ``fit(..., ckpt_path=last_lightning_checkpoint(ctx))``. The callback's saves are Lightning's own
  ``trainer.save_checkpoint``, which hands the trainer's state to that ``CheckpointIO`` plugin, and the plugin
  to the job's ``CheckpointStore`` (atomic, verified, pruned), with the loaders' state for a mid-epoch resume.

Both stop safely on SIGTERM (an eviction, a spot reclaim; ``pipeline.train.preemption``): every rank
finishes its step, they agree on the step, the trainer checkpoints it where the resume looks, rank 0
writes the preemption marker and every rank exits with ``PREEMPTED_EXIT_CODE``. Create the callback in
the main thread, before the trainer starts its loaders' workers.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from numbers import Number

from pipeline.errors import ConfigError
from pipeline.train import preemption
from pipeline.train.context import RunContext


def huggingface_callback(ctx: RunContext):
    """A ``transformers.TrainerCallback`` bound to ``ctx``."""
    from transformers import TrainerCallback

    _load_to_numbered_cpu()
    stop_request = preemption.install()

    def beat(state, phase: str = "training", force: bool = False) -> None:
        epoch = int(state.epoch) + 1 if state.epoch is not None else None
        ctx.heartbeat.beat(state.global_step, total=state.max_steps or None, epoch=epoch, phase=phase, force=force)

    class RunContextCallback(TrainerCallback):
        def __init__(self):
            self.preempted_at: int | None = None

        def on_init_end(self, args, state, control, **kwargs):
            if args.world_size != ctx.dist.world_size:
                raise ConfigError(
                    f"the Hugging Face Trainer sees {args.world_size} process(es) of the job's {ctx.dist.world_size}: "
                    f"each rank would train a model of its own and write the same checkpoint files; on a CPU, "
                    f"pass TrainingArguments(use_cpu=True) (on an accelerator the Trainer joins the ranks itself)")

        def on_step_end(self, args, state, control, **kwargs):
            beat(state)
            # Every rank, every optimizer step (a collective). At the last step the run just finishes.
            if stop_request.should_stop() and state.global_step < state.max_steps:
                self.preempted_at = state.global_step
                control.should_save = True  # checkpoint-N where last_huggingface_checkpoint finds it
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            values = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, Number) and not isinstance(v, bool)}
            if values and state.is_world_process_zero:
                ctx.metrics.log(values, step=state.global_step)

        def on_save(self, args, state, control, **kwargs):
            beat(state, "checkpointing", force=True)
            if self.preempted_at is not None:
                # The Trainer has written its checkpoint (rank 0 the model and optimizer, each rank its RNG
                # state); ``stop`` waits for every rank before the marker, then exits.
                beat(state, "preempted", force=True)
                stop_request.stop(rank=ctx.dist.rank, step=state.global_step)

        def on_evaluate(self, args, state, control, **kwargs):
            beat(state, "validating", force=True)

        def on_train_end(self, args, state, control, **kwargs):
            stop_request.finish()
            beat(state, "finished", force=True)

    return RunContextCallback()


@functools.cache  # once per process
def _load_to_numbered_cpu() -> None:
    """Let ``torch.load(..., map_location=torch.device("cpu", N))`` load onto the CPU.

    Accelerate names a multi-process CPU job's device ``cpu:0``, and the Trainer's resume loads the optimizer's
    state with that ``map_location``, which torch refuses ("don't know how to restore data location ... (tagged
    with cpu:0)"; torch 2.13, accelerate 1.15, transformers 4.57): no Trainer on CPU ranks could resume.
    Registered through torch's public hook for storage locations; it changes nothing that torch already
    loads."""
    import re

    import torch

    def restore(storage, location: str):
        return storage if re.fullmatch(r"cpu:\d+", location) else None

    # Priority 11: right after torch's own CPU entry (10); the others (20-26) are its accelerators.
    torch.serialization.register_package(11, lambda obj: None, restore)


def last_huggingface_checkpoint(ctx: RunContext) -> str | None:
    """The newest ``checkpoint-N`` folder a previous attempt left in ``ctx.checkpoint_dir``, if any."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(ctx.checkpoint_dir)) if ctx.checkpoint_dir.is_dir() else None


def lightning_callback(ctx: RunContext, *, every_steps: int, log_every_steps: int):
    """A ``lightning.pytorch.Callback`` bound to ``ctx``: heartbeats, progress lines, metrics, a
    checkpoint every ``every_steps`` optimizer steps (and at the end of each epoch), and the stop on SIGTERM.
    Its ``checkpoint_io`` goes in the Trainer's ``plugins``: the checkpoints reach the job's store through it."""
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.io import TorchCheckpointIO

    stop_request = preemption.install()

    class RunContextCheckpointIO(TorchCheckpointIO):
        """Lightning's checkpoint writer, sending the callback's saves to the job's ``CheckpointStore``. Any other
        save (a ``ModelCheckpoint``, a recipe's own call) and every load are Lightning's own, on files."""

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            if isinstance(storage_options, _ToStore):
                ctx.checkpoints.save(storage_options.step, checkpoint)
            else:
                super().save_checkpoint(checkpoint, path, storage_options)

    class LightningRunContext(pl.Callback):
        def __init__(self):
            self.checkpoint_io = RunContextCheckpointIO()
            self.started = time.perf_counter()
            self.resumed_from_step = 0
            self.saved_step = -1
            self._window = (time.perf_counter(), 0)  # (time, samples) at the last progress line
            self.samples = 0

        def setup(self, trainer, pl_module, stage):
            if trainer.strategy.checkpoint_io is not self.checkpoint_io:
                raise ConfigError("the Lightning Trainer writes its checkpoints with "
                                  f"{type(trainer.strategy.checkpoint_io).__name__}: pass the run context's callback's "
                                  "plugin, Trainer(plugins=[callback.checkpoint_io], ...), so that they land in the "
                                  "job's checkpoint store, where a restarted rank resumes from")
            ctx.heartbeat.beat(trainer.global_step, phase="setting up", force=True)

        def on_train_start(self, trainer, pl_module):
            # Lightning's own SIGTERM handler, installed when fit starts, broadcasts from inside the handler
            # on whichever rank the signal reaches first, and stops without a checkpoint: ours decides.
            stop_request.take_signal()
            ctx.heartbeat.beat(trainer.global_step, phase="starting", force=True)
            self.started = time.perf_counter()
            self.resumed_from_step = trainer.global_step
            self.saved_step = trainer.global_step
            self._window = (time.perf_counter(), 0)
            ctx.log(f"training with Lightning on {trainer.world_size} rank(s) ({trainer.strategy.__class__.__name__}, "
                    f"{trainer.num_devices} per node x {trainer.num_nodes} node(s)): "
                    f"{trainer.estimated_stepping_batches} steps"
                    + (f"; resumed from step {trainer.global_step} (epoch {trainer.current_epoch + 1})"
                       if trainer.global_step else ""))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step, total = trainer.global_step, trainer.estimated_stepping_batches
            self.samples += _batch_size(batch) * trainer.world_size
            ctx.heartbeat.beat(step, total=total, epoch=trainer.current_epoch + 1)
            if trainer.is_global_zero and (step % log_every_steps == 0 or step == total):
                started, first_samples = self._window
                elapsed = max(time.perf_counter() - started, 1e-9)
                loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
                rate = (self.samples - first_samples) / elapsed
                ctx.metrics.log({"step_loss": loss, "train_samples_per_s": rate}, step=step)
                ctx.log(f"step {step}/{total} epoch {trainer.current_epoch + 1} loss {loss:.4f} "
                        f"{rate:,.0f} samples/s")
                self._window = (time.perf_counter(), self.samples)
            if every_steps and step % every_steps == 0 and step != self.saved_step:
                self.save(trainer, step)
            if stop_request.should_stop() and step < total:  # every rank, every batch: a collective
                self.stop_preempted(trainer, step)

        def on_train_epoch_end(self, trainer, pl_module):
            # After the epoch's validation: the epoch's train_* and val_* metrics are both in.
            values = scalar_metrics(trainer)
            if values and trainer.is_global_zero:
                ctx.metrics.log(values | {"epoch": trainer.current_epoch + 1}, step=trainer.global_step)
                ctx.log(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} "
                        + " ".join(f"{k} {v:.4f}" for k, v in sorted(values.items())))
            if trainer.global_step != self.saved_step:
                self.save(trainer, trainer.global_step)

        def on_validation_start(self, trainer, pl_module):
            ctx.heartbeat.beat(trainer.global_step, phase="validating", force=True)

        def on_train_end(self, trainer, pl_module):
            stop_request.finish()
            ctx.heartbeat.beat(trainer.global_step, phase="finished", force=True)

        def summary(self) -> dict[str, float]:
            """This attempt's training throughput, validation included (all ranks' samples)."""
            elapsed = time.perf_counter() - self.started
            return {"samples_per_s": round(self.samples / elapsed, 1) if elapsed > 0 else 0.0,
                    "resumed_from_step": self.resumed_from_step}

        def save(self, trainer, step: int) -> None:
            """Every rank: the trainer's whole state (model, optimizer, loops, loaders' positions) as checkpoint
            ``step`` of the job's store, which rank 0 writes (``checkpoint_io``); every rank waits for it."""
            ctx.heartbeat.beat(step, phase="checkpointing", force=True)
            trainer.save_checkpoint(ctx.checkpoints.location, weights_only=False, storage_options=_ToStore(step))
            self.saved_step = step

        def stop_preempted(self, trainer, step: int) -> None:
            """Checkpoint ``step`` (unless just done) and exit every rank with ``PREEMPTED_EXIT_CODE``.

            The exit comes straight from this hook rather than after ``fit`` returns: with
            ``should_stop`` alone, Lightning would first run a validation and the epoch-end hooks (and
            ``min_epochs`` may refuse to stop), and the code after ``fit`` would export an unfinished model."""
            if step != self.saved_step:
                self.save(trainer, step)
            trainer.should_stop = True
            ctx.heartbeat.beat(step, phase="preempted", force=True)
            stop_request.stop(rank=trainer.global_rank, step=step)

    return LightningRunContext()


@dataclass(frozen=True)
class _ToStore:
    """``trainer.save_checkpoint``'s ``storage_options`` for a save into the job's store, as checkpoint ``step``."""

    step: int


def scalar_metrics(trainer) -> dict[str, float]:
    """The values the LightningModule logged (``self.log``) that are single numbers."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}


def last_lightning_checkpoint(ctx: RunContext) -> str | None:
    """The newest checkpoint file a previous attempt left that reads back intact, for ``fit(ckpt_path=...)``."""
    from pipeline.train.checkpoint import STATE_FILE

    latest = ctx.checkpoints.load_latest()
    return str(latest.path / STATE_FILE) if latest else None


def _batch_size(batch) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    return len(batch)
