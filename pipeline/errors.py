"""The two kinds of failure: a user's mistake (do not retry) and an infrastructure fault (retry).

The kind survives the process boundary: a rank that raises a ``UserError`` reports it in the job folder
before it dies (``pipeline.job_files.user_errors_reported``); the supervisor finds it and raises ``RankUserError``,
so neither a restart nor an Airflow retry follows (``pipeline.job.policy``).
"""

from __future__ import annotations



class PipelineError(Exception):
    """Base class of every error the pipeline raises on purpose."""


class UserError(PipelineError):
    """Bad config or bad data: retrying cannot help; the message says what to fix."""


class ConfigError(UserError):
    """A config key or value that is not allowed."""


class DataError(UserError):
    """Input data that is missing, malformed or of the wrong type."""


class ResultError(UserError):
    """A task's input that is not the result it should be: a field missing, or a value of the wrong type.

    A user error: retrying re-reads the same XCom value, so the task fails at once. What it names is
    usually a task wired in by hand (``release`` after a DAG author's own training task)."""


class OutOfSpace(UserError):
    """A write that failed for want of space (ENOSPC, EDQUOT) or of a writable file system (EROFS); the message
    names the path, the bytes the write needed and the bytes free (``pipeline.diskspace``).

    Not the user's mistake, but like one in that a retry cannot help: it writes to the same file system,
    no emptier than before. So it fails at once, never restarted nor retried: free space, then clear the
    task (a failed checkpoint save leaves the previous complete checkpoint, which training resumes from)."""


class RankUserError(UserError):
    """A rank of a training job failed with a user error (its type and message are in this one's)."""


class InfraError(PipelineError):
    """A fault of the machines or services around the job: worth a retry."""


class TrainingFailed(InfraError):
    """An attempt of a training job failed: a rank died, a node or pod failed. Restarted within
    ``launch.max_restarts``, then retryable."""

    restartable = True  # whether the supervisor replaces the attempt (training resumes from its checkpoint)


class TrainingPreempted(TrainingFailed):
    """Every rank was sent SIGTERM (an eviction, a spot reclaim), checkpointed at one step and exited."""


class TrainingStalled(TrainingFailed):
    """No training step completed for longer than the stall timeout; the ranks were stopped."""

    restartable = False  # a hang is the machine's or the network's: the task retry decides


class TrainingTimedOut(TrainingFailed):
    """The job ran past ``launch.timeout_s`` and was stopped."""

    restartable = False


class TrainingStopped(TrainingFailed):
    """The job was stopped from outside (the task was killed, cleared or marked failed)."""

    restartable = False


class NotStarted(TrainingFailed):
    """An attempt never got running (unschedulable, an image that cannot be pulled, a start-up limit)."""

    restartable = False


class TrainingPruned(PipelineError):
    """A sweep's pruner stopped the job after an epoch (``pipeline.sweep.pruning``): neither a user's mistake nor a
    fault, never restarted or retried; the trial task ends with it as its outcome."""

    restartable = False
