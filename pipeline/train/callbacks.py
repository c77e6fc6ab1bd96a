"""The run context for trainers that bring their own loop: Hugging Face ``Trainer`` callbacks.

A recipe's ``TrainSpec.run`` (or any script under the launcher) builds its ``Trainer`` with
``output_dir=ctx.checkpoint_dir`` and ``callbacks=[huggingface_callback(ctx)]`` and resumes with
``resume_from_checkpoint=last_huggingface_checkpoint(ctx)``: its checkpoints land where the launcher
resumes from, its steps feed the stall watchdog's heartbeat, and rank 0's logs reach MLflow through
the buffered sink.
"""

from __future__ import annotations

from numbers import Number

from pipeline.train.context import RunContext


def huggingface_callback(ctx: RunContext):
    """A ``transformers.TrainerCallback`` bound to ``ctx``."""
    from transformers import TrainerCallback

    def beat(state, phase: str = "training", force: bool = False) -> None:
        epoch = int(state.epoch) + 1 if state.epoch is not None else None
        ctx.heartbeat.beat(state.global_step, total=state.max_steps or None, epoch=epoch, phase=phase, force=force)

    class RunContextCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            beat(state)

        def on_log(self, args, state, control, logs=None, **kwargs):
            values = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, Number) and not isinstance(v, bool)}
            if values and state.is_world_process_zero:
                ctx.metrics.log(values, step=state.global_step)

        def on_save(self, args, state, control, **kwargs):
            beat(state, "checkpointing", force=True)

        def on_evaluate(self, args, state, control, **kwargs):
            beat(state, "validating", force=True)

        def on_train_end(self, args, state, control, **kwargs):
            beat(state, "finished", force=True)

    return RunContextCallback()


def last_huggingface_checkpoint(ctx: RunContext) -> str | None:
    """The newest ``checkpoint-N`` folder a previous attempt left in ``ctx.checkpoint_dir``, if any."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(ctx.checkpoint_dir)) if ctx.checkpoint_dir.is_dir() else None
