"""The one restart decision (pipeline.job.policy.decide) and the job folder it reads, without processes; every
place's real attempts are judged by it in tests/integration/test_place_contract.py."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import (
    DataError,
    NotStarted,
    RankUserError,
    TrainingFailed,
    TrainingPreempted,
    TrainingStalled,
    TrainingStopped,
    TrainingTimedOut,
)
from pipeline.job.policy import Ended, Findings, decide
from pipeline.job_files import JobFiles, mark_preempted, user_errors_reported


def test_success_finishes_whatever_the_folder_holds():
    findings = Findings(user_error=RankUserError("rank 1: DataError: x"), preempted_step=3)
    assert decide(Ended("succeeded"), findings, restart=0, max_restarts=2).action == "finish"


@pytest.mark.parametrize("restart, action", [(0, "restart"), (1, "restart"), (2, "fail")])
def test_a_failed_attempt_is_restarted_while_restarts_are_left_then_fails_as_retryable(restart, action):
    decision = decide(Ended("failed", "torchrun exited with code 1"), Findings(rank_failure="local rank 1 failed: boom"),
                      restart=restart, max_restarts=2)
    assert decision.action == action
    assert type(decision.error) is TrainingFailed and "local rank 1 failed: boom" in str(decision.error)
    if action == "restart":
        assert decision.notice.startswith("torchrun exited with code 1; local rank 1 failed: boom; restarting every "
                                          f"rank ({restart + 1} of 2)")


def test_a_user_error_fails_at_once_even_with_restarts_left():
    error = RankUserError("rank 0: DataError: column 'x' missing")
    decision = decide(Ended("failed", "torchrun exited with code 1"), Findings(user_error=error, preempted_step=4),
                      restart=0, max_restarts=5)
    assert (decision.action, decision.error) == ("fail", error)


def test_a_preemption_is_restarted_and_names_its_step_then_fails_as_retryable():
    ended = Ended("failed", "torchrun exited with code 75")
    restarted = decide(ended, Findings(preempted_step=12), restart=0, max_restarts=1)
    assert restarted.action == "restart" and type(restarted.error) is TrainingPreempted
    assert "checkpointed at step 12" in restarted.notice
    last = decide(ended, Findings(preempted_step=12), restart=1, max_restarts=1)
    assert last.action == "fail" and last.error.restartable  # the task retry resumes it


@pytest.mark.parametrize("status, error_type", [("stalled", TrainingStalled), ("timeout", TrainingTimedOut),
                                                ("not_started", NotStarted), ("stopped", TrainingStopped)])
def test_stalls_timeouts_starts_and_stops_are_never_restarted(status, error_type):
    decision = decide(Ended(status, "why"), Findings(), restart=0, max_restarts=3, tail=["last line"])
    assert decision.action == "fail" and type(decision.error) is error_type


def test_an_unknown_ending_is_a_bug_not_a_failure():
    with pytest.raises(ValueError, match="'crashed'"):
        decide(Ended("crashed"), Findings(), restart=0, max_restarts=1)


def test_findings_are_what_the_ranks_wrote_in_the_job_folder(tmp_path, monkeypatch):
    files = JobFiles(tmp_path / "job")
    files.begin_attempt(0)
    assert Findings.read(files) == Findings()
    monkeypatch.setenv("PIPELINE_ERROR_DIR", str(files.errors))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(DataError), user_errors_reported():
        raise DataError("row 3: bad")
    mark_preempted(files.progress, rank=0, step=7)
    log_dir = tmp_path / "logs" / "attempt_0" / "1"
    log_dir.mkdir(parents=True)
    (log_dir / "error.json").write_text(json.dumps({"message": {"extraInfo": {"py_callstack": "Trace\nValueError: x"}}}))
    found = Findings.read(files, tmp_path / "logs")
    assert str(found.user_error) == "rank 1: DataError: row 3: bad" and found.preempted_step == 7
    assert found.rank_failure.startswith("local rank 1 failed (attempt 0): ValueError: x")
    files.begin_attempt(1)  # the next attempt starts without them
    assert Findings.read(files) == Findings()
    mark_preempted(files.progress, rank=0, step=9)
    files.clear_preemption()
    assert Findings.read(files).preempted_step is None


def test_a_pruned_attempt_ends_without_a_restart_even_with_restarts_left_and_a_preemption_marker():
    """A sweep's pruner stopped the job: the ranks checkpointed on SIGTERM like a preemption, but it is its own end."""
    from pipeline.errors import TrainingPruned

    decision = decide(Ended("pruned", "trial 3 pruned after epoch 2"), Findings(preempted_step=40), restart=0,
                      max_restarts=3)
    assert decision.action == "fail" and isinstance(decision.error, TrainingPruned)
    assert not isinstance(decision.error, TrainingFailed)  # not a failure: the trial task catches it and succeeds
    assert str(decision.error) == "trial 3 pruned after epoch 2"


def test_an_attempts_beginning_and_end_are_the_same_for_every_supervisor(tmp_path, monkeypatch):
    """pipeline.job.attempts, what the task's supervisor and a deferred task's completion both call: the folder made
    ready, the attempt's cost recorded under its restart number, and decide asked with launch.max_restarts."""
    from pipeline.job import attempts, cost
    from pipeline.job.spec import Attempt, JobSpec, launch_config

    spec = JobSpec(entry=["-m", "x"], job_dir=tmp_path / "job", launch=launch_config({"max_restarts": 2}))
    attempt = Attempt(spec, 1)
    mark_preempted(spec.files.progress, rank=0, step=4)  # the previous attempt's: not this one's
    assert attempts.begin(attempt) is None  # a shared folder: no copy on a store
    assert Findings.read(spec.files) == Findings()
    failed = Ended("failed", "a node died")
    attempts.close(attempt, failed.status, started=0.0, store=None)
    assert cost.summarize(spec.files.attempts)["attempts"] == 1
    assert json.loads(spec.files.attempts.read_text())["restart"] == 1
    decision = attempts.verdict(attempt, failed)
    assert decision.action == "restart" and decision.max_restarts == 2
    monkeypatch.setenv("PIPELINE_ERROR_DIR", str(spec.files.errors))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DataError), user_errors_reported():
        raise DataError("row 3: bad")
    assert isinstance(attempts.verdict(attempt, failed).error, RankUserError)  # never restarted
    assert attempts.verdict(attempt, failed).action == "fail"
