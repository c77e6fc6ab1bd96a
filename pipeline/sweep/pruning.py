"""A running trial's pruning: each epoch's objective value, read from the job's metrics file as rank 0 appends it
(``metrics.jsonl``: epoch lines carry ``epoch``), is reported to the trial once, and the study's pruner asked.

``EpochPruner`` is what the supervisor asks on every poll (``Supervisor(pruner=...)``): a reason it returns stops the
job as ``pruned``. The ranks know nothing of it: no collective, no Optuna in a rank, any place (local processes,
Kubernetes pods, Ray workers) the same, since every place shares the job folder with the supervisor.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import ConfigError


class EpochPruner:
    def __init__(self, trial, metrics: Path, objective: str):
        self.trial, self.metrics, self.objective = trial, Path(metrics), objective
        self.offset = 0
        # Epochs an earlier try reported (a retried trial reads its metrics file from the start again).
        done = [t for t in trial.study.get_trials(deepcopy=False) if t.number == trial.number]
        self.reported: dict[int, float] = dict(done[0].intermediate_values) if done else {}
        self.asked = False  # a retried trial asks once about the epochs an earlier try reported

    def __call__(self) -> str | None:
        """A reason to stop when the pruner says so after a new epoch's value, else None."""
        fresh = False
        for epoch, value in self._epochs():
            if epoch not in self.reported:
                self.trial.report(value, epoch)
                self.reported[epoch] = value
                fresh = True
        if not (fresh or (self.reported and not self.asked)):
            return None
        self.asked = True
        if not self.trial.should_prune():
            return None
        epoch = max(self.reported)
        return (f"trial {self.trial.number} pruned after epoch {epoch}: {self.objective} {self.reported[epoch]:.6g} "
                f"is not among the better trials' at that epoch ({type(self.trial.study.pruner).__name__})")

    def _epochs(self) -> list[tuple[int, float]]:
        """The epoch lines appended since the last call (whole lines only: rank 0 may be writing one)."""
        if not self.metrics.exists():
            return []
        with open(self.metrics, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        found = []
        for line in chunk.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            self.offset += len(line)
            try:
                values = json.loads(line)["metrics"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a killed attempt
            if "epoch" not in values:
                continue
            if self.objective not in values:
                raise ConfigError(f"objective={self.objective!r}: the epoch lines of {self.metrics} have "
                                  f"{sorted(k for k in values if k != 'epoch')}; expected one of them")
            found.append((int(values["epoch"]), float(values[self.objective])))  # NaN too: a diverged trial is pruned
        return found
