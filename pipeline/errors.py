"""The two kinds of failure: a user's mistake (do not retry) and an infrastructure fault (retry)."""


class PipelineError(Exception):
    """Base class of every error the pipeline raises on purpose."""


class UserError(PipelineError):
    """Bad config or bad data: retrying cannot help; the message says what to fix."""


class ConfigError(UserError):
    """A config key or value that is not allowed."""


class DataError(UserError):
    """Input data that is missing, malformed or of the wrong type."""


class InfraError(PipelineError):
    """A fault of the machines or services around the job: worth a retry."""


class TrainingFailed(InfraError):
    """The torchrun job exited non-zero."""


class TrainingStalled(TrainingFailed):
    """No training step completed for longer than the stall timeout; the ranks were stopped."""
