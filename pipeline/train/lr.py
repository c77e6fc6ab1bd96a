"""The learning-rate schedule of the generic loop: linear warm-up, then constant or cosine, as a function of the
training done, so that a resume on another number of ranks goes on from the same LR."""

from __future__ import annotations

import math

from pipeline.config import TrainConfig


class LrFactor:
    """Picklable LR multiplier (LambdaLR keeps a callable object's state in its state_dict), a function of the
    training done: warm-up and schedule are in the first world's steps, and a resume on another number of ranks
    (``rescale``) maps its steps onto them by the samples each takes, so the LR goes on from where it was."""

    def __init__(self, tc: TrainConfig, total_steps: int):
        self.schedule, self.warmup_steps, self.total_steps = tc.lr_schedule, tc.warmup_steps, total_steps
        # Since step ``origin_step`` (the last resume on another world), each step is ``scale`` first-world steps.
        self.origin_step, self.origin_done, self.scale = 0, 0.0, 1.0

    def rescale(self, step: int, ratio: float) -> None:
        """From ``step`` on, each step takes ``ratio`` times the samples of the steps before it."""
        self.origin_done, self.origin_step, self.scale = self.done(step), step, self.scale * ratio

    def done(self, step: int) -> float:
        """The training done after ``step`` steps, in the first world's steps."""
        return self.origin_done + (step - self.origin_step) * self.scale

    def __call__(self, step: int) -> float:
        done = self.done(step)
        if done < self.warmup_steps:
            return (done + 1) / self.warmup_steps
        if self.schedule == "cosine":
            progress = (done - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
