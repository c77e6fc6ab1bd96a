"""The local place, with real torchrun processes: what only it does (its guard, its error files, signals of
the task process). What every place guarantees is in test_place_contract.py."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipeline.errors import TrainingFailed, TrainingStalled, TrainingTimedOut, UserError
from tests.jobs import run_torchrun
from tests.processes import cmdline, pids_with, wait_until_gone

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        rank = int(os.environ["RANK"])
        print(f"hello from rank {rank}", flush=True)
        mode = sys.argv[1]
        if mode == "fail" and rank == 1:
            raise ValueError("boom from rank 1")
        if mode == "user_error" and rank == 1:
            from pipeline.errors import DataError
            from pipeline.job_files import user_errors_reported

            with user_errors_reported():
                raise DataError("shard 3, row 17, column 'x': value 'abc'; expected a number")
        if mode == "crash" and rank == 1:
            os._exit(3)  # a rank dying the way an OOM kill or a lost device does: no error of the user's
        if mode == "sleep":
            time.sleep(600)
        if mode == "native_hang":  # a decoder stuck in native code, deaf to SIGTERM (libpng's hang was so)
            import ctypes, signal
            from pipeline.job_files import Heartbeat

            Heartbeat.from_env().beat(1, total=10, force=True)  # training has begun: the stall clock runs
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            while True:
                ctypes.CDLL(None).pause()  # returns only when a handler ran (the stack-dump signal's)

    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture()
def script_dir(tmp_path):
    (tmp_path / "toy_job.py").write_text(SCRIPT)
    return tmp_path


def test_a_failing_rank_fails_the_launch_with_its_traceback(script_dir, tmp_path):
    with pytest.raises(TrainingFailed) as err:
        run_torchrun(["-m", "toy_job", "fail"], nproc_per_node=2, job_dir=tmp_path / "job",
                     env={"PYTHONPATH": str(script_dir)}, emit=lambda line: None, grace_period_s=2)
    message = str(err.value)
    assert "torchrun exited with code 1" in message
    assert "ValueError: boom from rank 1" in message


def test_the_demos_preload_starts_once_a_job_task_has_started_its_processes(monkeypatch):
    """make demo's warm-up (pipeline.airflow.preload): an Airflow listener sees a job task start, then the
    preload waits for the job's first process; another task's start leaves it waiting."""
    import subprocess
    import sys
    import threading
    from types import SimpleNamespace

    from airflow.sdk.listener import get_listener_manager
    from airflow.utils.state import TaskInstanceState

    from pipeline.airflow import preload
    from pipeline.airflow.operator import TorchrunOperator

    imported = threading.Event()
    monkeypatch.setattr(preload, "preload", lambda names: imported.set())
    thread = preload.preload_while_a_job_runs(nice=0, launch_wait_s=600)
    hook = get_listener_manager().hook
    hook.on_task_instance_running(previous_state=TaskInstanceState.QUEUED, task_instance=SimpleNamespace(task=object()))
    hook.on_task_instance_running(previous_state=TaskInstanceState.QUEUED,
                                  task_instance=SimpleNamespace(task=TorchrunOperator(task_id="t", entry=["x.py"])))
    assert not imported.wait(0.5)  # the job task has started, its processes not yet
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        thread.join(60)
        assert imported.is_set()
    finally:
        child.communicate(b"", timeout=60)


def test_an_infrastructure_fault_in_a_rank_is_restarted_then_fails_as_retryable(script_dir, tmp_path):
    lines = []
    with pytest.raises(TrainingFailed) as err:
        run_torchrun(["-m", "toy_job", "crash"], nproc_per_node=2, job_dir=tmp_path / "job", max_restarts=1,
                     env={"PYTHONPATH": str(script_dir)}, emit=lines.append, grace_period_s=2)
    assert not isinstance(err.value, UserError)
    assert sum(line.startswith("launching:") for line in lines) == 2  # the first launch and one restart
    assert any("restarting every rank (1 of 1)" in line for line in lines)


def test_the_operator_turns_a_rank_user_error_into_a_failure_without_retries(script_dir, tmp_path):
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException

    from pipeline.airflow import TorchrunOperator

    op = TorchrunOperator(task_id="fit", entry=["-m", "toy_job", "user_error"], nproc_per_node=2, max_restarts=1,
                          env={"PYTHONPATH": str(script_dir)}, retries=3)
    ti = SimpleNamespace(dag_id="dag", run_id=f"user-error-{os.getpid()}", task_id="fit", map_index=-1, try_number=1)
    with pytest.raises(AirflowFailException, match="DataError: shard 3, row 17"):
        op.execute({"ti": ti})


def test_operator_launch_options_are_the_config_fields_with_their_rules():
    from pipeline.airflow import TorchrunOperator
    from pipeline.errors import ConfigError

    op = TorchrunOperator(task_id="fit", entry=["train.py"], nproc_per_node=4, stall_timeout_s=30)
    assert (op.launch.nproc_per_node, op.launch.stall_timeout_s, op.launch.kind) == (4, 30.0, "local")
    with pytest.raises(ConfigError, match="launch.nproc_per_node=0: expected a value >= 1"):
        TorchrunOperator(task_id="fit2", entry=["train.py"], nproc_per_node=0)


@pytest.mark.parametrize("watch, error", [({"stall_timeout_s": 2}, TrainingStalled), ({"timeout_s": 20}, TrainingTimedOut)],
                         ids=["stall-watchdog", "run-timeout"])
def test_ranks_stuck_in_native_code_that_ignore_sigterm_are_killed_after_the_grace_period(script_dir, tmp_path,
                                                                                           watch, error):
    marker = f"toy-native-{os.getpid()}-{tmp_path.name}"
    lines = []
    with pytest.raises(error):
        run_torchrun(["-m", "toy_job", "native_hang", marker], nproc_per_node=2, job_dir=tmp_path / "job",
                     env={"PYTHONPATH": str(script_dir)}, emit=lines.append, grace_period_s=1, **watch)
    # SIGTERM did not end them: the guard's SIGKILL did, one grace period later.
    assert any(line.startswith("guard: ") and "after SIGTERM: SIGKILL" in line for line in lines), lines[-20:]
    assert wait_until_gone(marker) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_killing_the_supervising_process_stops_every_rank(script_dir, tmp_path, signum):
    """SIGTERM or SIGINT (a worker shutting down) reaches the supervisor's handler, which stops the job first.
    SIGKILL, which leaves the job to the guard (PR_SET_PDEATHSIG), is in the place contract suite."""
    marker = f"toy-job-{os.getpid()}"
    driver = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(script_dir)!r})
        from tests.jobs import run_torchrun
        from pathlib import Path
        run_torchrun(["-m", "toy_job", "sleep", {marker!r}], nproc_per_node=2, job_dir=Path({str(tmp_path / "job")!r}),
                     env={{"PYTHONPATH": {str(script_dir)!r}}}, grace_period_s=3, emit=print)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    started = 0
    while time.monotonic() < deadline and started < 2:
        line = proc.stdout.readline()
        started += "hello from rank" in line
    assert started == 2, "the ranks did not start"
    assert len(pids_with(marker)) >= 4  # the guard, the torchrun agent and two ranks
    proc.send_signal(signum)
    proc.wait(timeout=20)
    assert wait_until_gone(marker) == []


def test_on_kill_of_the_operator_stops_every_rank(script_dir, tmp_path):
    """What Airflow does when a running task is cleared or marked failed: on_kill, then the task ends."""
    import threading
    from types import SimpleNamespace

    from pipeline.airflow import TorchrunOperator

    marker = f"toy-on-kill-{os.getpid()}"
    op = TorchrunOperator(task_id="train", entry=[str(script_dir / "toy_job.py"), "sleep", marker],
                          nproc_per_node=2, grace_period_s=3)
    ti = SimpleNamespace(dag_id="dag", run_id="run", task_id="train", map_index=-1, try_number=1)
    outcome = {}

    def execute():
        try:
            op.execute({"ti": ti})
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=execute)
    thread.start()
    deadline = time.monotonic() + 60
    while len(pids_with(marker)) < 4 and time.monotonic() < deadline:  # guard, agent, two ranks
        time.sleep(0.2)
    assert len(pids_with(marker)) >= 4, "the job did not start"
    op.on_kill()
    thread.join(timeout=30)
    assert isinstance(outcome.get("error"), TrainingFailed)
    assert wait_until_gone(marker) == []


def test_ranks_orphaned_by_a_killed_torchrun_agent_are_stopped_by_the_guard(script_dir, tmp_path):
    """torchrun puts every rank in a session of its own: killing the agent alone would orphan them."""
    import threading

    marker = f"toy-agent-kill-{os.getpid()}"
    errors = []

    def run():
        try:
            run_torchrun(["-m", "toy_job", "sleep", marker], nproc_per_node=2, job_dir=tmp_path / "job",
                         env={"PYTHONPATH": str(script_dir)}, emit=lambda line: None, grace_period_s=3)
        except TrainingFailed as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while len(pids_with(marker)) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    agents = [pid for pid in pids_with(marker)  # the guard's command line names the agent's module too
              if b"pipeline.job.local.torchrun" in cmdline(pid)
              and b"pipeline.job.local.process_group" not in cmdline(pid)]
    assert len(agents) == 1
    os.kill(agents[0], signal.SIGKILL)
    thread.join(timeout=30)
    assert errors, "the launch did not fail"
    assert wait_until_gone(marker) == []
